"""Kernel backends: `--attention-backend xla|pallas` and `--moe-runner-backend xla|pallas|blocked`.

On a GPU the default is pallas (the Triton kernels of `kernels_pallas`); on a CPU it is xla for attention and
auto for the MoE, and pallas there runs the same kernels in interpret mode, for checking. For the MoE, xla is
`lax.ragged_dot`, which XLA expands into a product per expert over every row (what `plan --compile` shows at
full size); blocked is `jaxdp.model.grouped.grouped_matmul`, the same products by blocks of rows, for every
kind of expert; pallas is the grouped NVFP4 GEMM for NVFP4 experts, the grouped block-FP8 GEMM for FP8 ones
(both reading the layer in place from the layer stack, with the router: `jaxdp.model.stacked`) and the blocked
form for bf16 ones;
auto gathers the chosen experts' weights per (row, choice) pair for few rows and is blocked for many
(`jaxdp.model.moe.routed_experts`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from collections.abc import Callable

import jax

ATTENTION_BACKENDS = ("xla", "pallas")
MOE_RUNNER_BACKENDS = ("auto", "xla", "pallas", "blocked")  # how the routed experts multiply (jaxdp.model.moe)


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
    backend = backend or ("pallas" if _on_gpu(platform) else "auto")
    if backend not in MOE_RUNNER_BACKENDS:
        raise ValueError(f"--moe-runner-backend {backend!r} is not one of {', '.join(MOE_RUNNER_BACKENDS)}")
    return backend


def keep_freed_host_memory() -> bool:
    """On a CPU, have glibc's malloc keep the memory a step frees for the next step (no mmap per allocation,
    no trimming) instead of returning it to the kernel and faulting it in again page by page: XLA:CPU
    allocates a step's temporaries (tens of MiB: gathered expert weights, a layer's weights sliced out of the
    stack) at every step, and the page faults cost more than the step's reads (a 32 MiB gather: 46 ms, 1.8 ms
    kept). The process's resident memory stays at its peak, as a GPU's caching allocator does. Process-wide:
    called once by the entry points (serve, one_batch, the benchmarks), never by the library. Returns whether it
    applied (a CPU backend on glibc)."""
    if jax.default_backend() != "cpu":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # (a Python int past a C int was cut to 0: trim always)
    ok = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    if ok:
        logging.getLogger("jaxdp").info("CPU: freed host memory is kept for the next step (no mmap, no trim)")
    return ok


def default_dtype() -> str:
    """`--dtype auto`: bfloat16 on a GPU; float32 on a CPU, and says why in one log line."""
    if jax.default_backend() == "gpu":
        return "bfloat16"
    logging.getLogger("jaxdp").info(
        "dtype auto: float32 on a CPU (weights converted once at load): XLA:CPU multiplies bf16 fast only as "
        "2-D products with float32 accumulation, and converts the whole stacked bf16 weights of the others to "
        "float32 every step (docs/performance.md)")
    return "float32"
