"""jaxdp: a JAX serving engine for MLA + MoE models with data-parallel attention."""

__version__ = "0.1.0"


def __getattr__(name):  # `jaxdp.Engine` without importing JAX on `import jaxdp`
    if name in ("Engine", "EngineConfig", "SamplingParams"):
        from jaxdp import engine

        return getattr(engine, name)
    raise AttributeError(name)
