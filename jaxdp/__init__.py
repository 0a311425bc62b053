"""jaxdp: a JAX serving engine for MLA + MoE models with data-parallel attention."""

__version__ = "0.1.0"
