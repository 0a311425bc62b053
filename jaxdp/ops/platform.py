"""What the platform the step runs on implies beyond the kernels: the default dtype, and on a CPU the allocator's
setting that keeps a step's freed memory for the next step."""

from __future__ import annotations

import ctypes
import logging

import jax


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


def default_dtype(stored: str | None = None) -> str:
    """`--dtype auto`: bfloat16 on a GPU; on a CPU the weights as stored when the checkpoint holds them in bfloat16
    (`stored`, `jaxdp.model.checkpoint.stored_float_dtype`): the native CPU kernels read bf16 weights and caches
    in place with float32 accumulation, half the bytes of float32 and at least as fast (docs/performance.md);
    float32 otherwise (a float32 checkpoint, random weights, FP8 weights dequantized by XLA), and says why in one
    log line."""
    if jax.default_backend() == "gpu" or stored == "bfloat16":
        return "bfloat16"
    logging.getLogger("jaxdp").info(
        "dtype auto: float32 on a CPU for a checkpoint not stored in bf16 (%s): XLA:CPU multiplies bf16 fast only "
        "as 2-D products with float32 accumulation (docs/performance.md)", stored or "no safetensors")
    return "float32"
