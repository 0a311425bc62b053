"""The HTTP layer: a FastAPI app (OpenAI-compatible and SGLang-native endpoints, Prometheus metrics) over an
Engine or a ReplicaSet. `python -m jaxdp.serve` builds and runs it."""

from jaxdp.api.app import create_app
from jaxdp.api.replicas import ReplicaSet

__all__ = ["ReplicaSet", "create_app"]
