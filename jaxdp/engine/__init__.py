"""The serving engine: schedulers per DP rank, page pools, prefix caches, the loop, sampling.

The names below load on first use (PEP 562), so that a tool which needs one submodule (`one_batch` needs
`jaxdp.engine.setup`) does not import the engine's HTTP and disaggregation stack with it."""

import importlib

_NAMES = {"Engine": "jaxdp.engine.loop", "EngineConfig": "jaxdp.engine.options",
          "BadRequest": "jaxdp.engine.sched.request", "Request": "jaxdp.engine.sched.request",
          "SamplingParams": "jaxdp.engine.sched.request"}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
