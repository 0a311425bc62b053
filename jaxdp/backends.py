"""Kernel backends: `--attention-backend xla|pallas` (and, later, `--moe-runner-backend`).

On a GPU the default is pallas (the Triton kernels of `kernels_pallas`); on a CPU it is xla, and
pallas there runs the same kernels in interpret mode, for checking.
"""

from __future__ import annotations

import jax

ATTENTION_BACKENDS = ("xla", "pallas")


def default_attention_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def decode_kernel(backend: str | None):
    """The absorbed-MLA decode function the model calls, or None for the XLA path."""
    backend = backend or default_attention_backend()
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "xla":
        return None
    from kernels_pallas.mla_decode import mla_decode

    return mla_decode
