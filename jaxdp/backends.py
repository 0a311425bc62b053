"""Kernel backends: `--attention-backend xla|pallas` and `--moe-runner-backend xla|pallas|blocked`.

On a GPU the default is pallas (the Triton kernels of `kernels_pallas`); on a CPU it is xla, and pallas
there runs the same kernels in interpret mode, for checking. For the MoE, xla is `lax.ragged_dot`,
which XLA expands into a product per expert over every row (what `plan --compile` shows at full size);
blocked is `jaxdp.model.grouped.grouped_matmul`, the same products by blocks of rows, for every kind of
expert; pallas is the grouped NVFP4 GEMM for NVFP4 experts and the blocked form for bf16 and FP8 ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

ATTENTION_BACKENDS = ("xla", "pallas")
MOE_RUNNER_BACKENDS = ("xla", "pallas", "blocked")  # how the routed experts multiply (jaxdp.model.moe)


def _on_gpu(platform: str | None) -> bool:
    """platform: that of the devices the step is compiled for (a mesh of simulated GPUs, `jaxdp.planner`);
    None: JAX's default backend."""
    return (platform or jax.default_backend()) in ("gpu", "cuda", "rocm")


def default_attention_backend(platform: str | None = None) -> str:
    return "pallas" if _on_gpu(platform) else "xla"


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """The Pallas decode kernels: called, the dense absorbed-MLA decode over the page table; `.sparse`, the
    DSA decode over the selected latents (the model reads it for layers with a top-k selection)."""

    dense: Callable
    sparse: Callable

    def __call__(self, *args, **kwargs):
        return self.dense(*args, **kwargs)


def decode_kernel(backend: str | None, platform: str | None = None):
    """The absorbed-MLA decode kernels the model calls (DecodeKernels), or None for the XLA path."""
    backend = backend or default_attention_backend(platform)
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "xla":
        return None
    from kernels_pallas.mla_decode import mla_decode
    from kernels_pallas.sparse_mla_decode import sparse_mla_decode

    return DecodeKernels(mla_decode, sparse_mla_decode)


def moe_runner_backend(backend: str | None, platform: str | None = None) -> str:
    """The MoE runner backend name the step gives the model (None: the device's default)."""
    backend = backend or ("pallas" if _on_gpu(platform) else "xla")
    if backend not in MOE_RUNNER_BACKENDS:
        raise ValueError(f"--moe-runner-backend {backend!r} is not one of {', '.join(MOE_RUNNER_BACKENDS)}")
    return backend
