"""The serving engine: schedulers per DP rank, page pools, prefix caches, the loop, sampling."""

from jaxdp.engine.engine import Engine
from jaxdp.engine.options import EngineConfig
from jaxdp.engine.request import BadRequest, Request, SamplingParams

__all__ = ["BadRequest", "Engine", "EngineConfig", "Request", "SamplingParams"]
