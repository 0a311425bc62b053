"""Kernel backends: `--attention-backend xla|pallas` and `--moe-runner-backend xla|pallas`.

On a GPU the default is pallas (the Triton kernels of `kernels_pallas`); on a CPU it is xla, and
pallas there runs the same kernels in interpret mode, for checking. The MoE runner backend applies to
NVFP4 experts (the grouped NVFP4 GEMM, or dequantize + `lax.ragged_dot`); bf16 experts always run
`lax.ragged_dot`.
"""

from __future__ import annotations

import jax

ATTENTION_BACKENDS = ("xla", "pallas")
MOE_RUNNER_BACKENDS = ("xla", "pallas")


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


def moe_runner_backend(backend: str | None) -> str:
    """The MoE runner backend name the step gives the model (None: the device's default)."""
    backend = backend or ("pallas" if jax.default_backend() == "gpu" else "xla")
    if backend not in MOE_RUNNER_BACKENDS:
        raise ValueError(f"--moe-runner-backend {backend!r} is not one of {', '.join(MOE_RUNNER_BACKENDS)}")
    return backend
