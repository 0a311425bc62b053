"""jaxdp: a JAX serving engine for MLA + MoE models with data-parallel attention."""

import importlib

__version__ = "0.1.0"


def __getattr__(name):  # `jaxdp.Engine` without importing JAX on `import jaxdp` (PEP 562)
    if name in ("Engine", "EngineConfig", "SamplingParams"):
        return getattr(importlib.import_module("jaxdp.engine"), name)
    raise AttributeError(name)
