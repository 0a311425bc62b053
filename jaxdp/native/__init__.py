"""Native CPU kernels: XLA FFI custom calls, compiled on first use by the machine's C++ compiler.

XLA:CPU's products read whole buffers: a layer sliced out of a layer stack, an expert out of a layer, is
copied before the product reads it, and its one-row products read at about half the machine's bandwidth
(docs/performance.md). `grouped_matmul` (`matmul.cc`) multiplies rows by one layer's weights (one group) or
by its experts (rows sorted by expert) where they lie in the stack, and `head_matmul` multiplies each head's
rows by its columns of MLA's kv_b_proj (W_UK, transposed, and W_UV) where they lie, and `mla_decode` attends
a decode step's rows over the paged latent cache without gathering it; float32 or bf16 weights and caches,
float32 accumulation, on the calling thread and XLA's intra-op pool. They are the "native" backend of the ops
that `jaxdp.ops` chooses for (`jaxdp.ops.gemm.projection`, `jaxdp.ops.experts.routed_experts`,
`jaxdp.ops.attention.mla_decode_native`, `jaxdp.ops.gemm.lm_head_product`; `cache_write`, a step's rows into a bf16
cache in place, of `jaxdp.ops.attention.write_rows`): the model never calls them itself.

It is built once per machine into the cache (`jaxdp.cache.cache_dir() / "native"`, keyed by the source, the
compiler, JAX's headers and the CPU's flags) with `c++ -O3 -march=native`; where no compiler is found or the
build fails, `available()` is False, one log line says so, and the products stay XLA's. `JAXDP_NATIVE=0`
turns them off (the step then is what it was before them, for comparisons).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.cache import cache_dir

log = logging.getLogger("jaxdp.native")

SOURCE = Path(__file__).with_name("matmul.cc")
TARGET = "jaxdp_grouped_matmul"
HEAD_TARGET = "jaxdp_head_matmul"
DECODE_TARGET = "jaxdp_mla_decode"
WRITE_TARGET = "jaxdp_cache_write"
FLAGS = ("-O3", "-march=native", "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC", "-w")
ENV = "JAXDP_NATIVE"  # "0": never build or use them


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build() -> Path:
    """The shared library, compiled if this machine has not compiled this source yet."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise OSError("no C++ compiler (c++ or g++) on the PATH")
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), version, include, jax.__version__, _cpu_flags(),
                                    " ".join(FLAGS)]).encode()).hexdigest()[:16]
    lib = cache_dir() / "native" / f"jaxdp_matmul-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)  # then renamed: concurrent builders never clash
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, "-I", include, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"{Path(cxx).name} failed: {done.stderr.strip().splitlines()[-1:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return lib


@functools.cache
def _load() -> bool:
    """Build (once per machine), load and register the kernels with XLA:CPU, once per process (XLA refuses a
    second registration of a name from another library)."""
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("jaxdp's native CPU kernels are not built (%s): the CPU's products run in XLA, slower", e)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxdpGroupedMatmul), platform="cpu")
    jax.ffi.register_ffi_target(HEAD_TARGET, jax.ffi.pycapsule(lib.JaxdpHeadMatmul), platform="cpu")
    jax.ffi.register_ffi_target(DECODE_TARGET, jax.ffi.pycapsule(lib.JaxdpMlaDecode), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(lib.JaxdpCacheWrite), platform="cpu")
    return True


def available() -> bool:
    """Whether the model's products take the native kernels: built and registered with XLA:CPU (on the first
    call), and not turned off (`JAXDP_NATIVE=0`, read at each call: a step traced after it changes compiles
    without them)."""
    return os.environ.get(ENV, "1") != "0" and _load()


def takes(*arrays) -> bool:
    """Whether the kernels take these operands: float32 or bf16 each, and the kernels built (`available`)."""
    return all(jnp.dtype(a.dtype) in (jnp.float32, jnp.bfloat16) for a in arrays) and available()


def _call(target: str, out: jax.ShapeDtypeStruct):
    """The custom call `target` (registering the kernels on first use; they must be `available()`)."""
    if not available():
        raise RuntimeError("jaxdp's native CPU kernels are not built on this machine (see the log): use XLA's products")
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")


def grouped_matmul(x_MK: jax.Array, w_LEKN: jax.Array, layer, sizes_E: jax.Array, kblocks: int = 1) -> jax.Array:
    """Rows of x (sorted by group) times their group's matrix of layer `layer` of the stack `w_LEKN`, read in
    place: the first sizes_E[0] rows by w[layer, 0], the next sizes_E[1] by w[layer, 1], ...; rows past the
    groups give zeros (w [L, K, N]: one group). x and w float32 or bfloat16, any N; float32 [M, N]
    out. Only where `available()`, and on a CPU (XLA:CPU's custom call; no derivative).
    kblocks > 1 (dividing K): [kblocks, M, N], the partial products over each block of K on its own, each the bits
    the product of that block's columns of x by its rows of w gives (the fixed reduction tree's partials,
    docs/determinism.md)."""
    M, K, N = x_MK.shape[0], x_MK.shape[1], w_LEKN.shape[-1]
    if kblocks < 1 or K % kblocks:
        raise ValueError(f"{kblocks} blocks do not divide the contraction's {K} columns")
    call = _call(TARGET, jax.ShapeDtypeStruct((kblocks, M, N), jnp.float32))
    y = call(x_MK, w_LEKN, jnp.asarray(layer, jnp.int32), sizes_E.astype(jnp.int32), kblocks=np.int64(kblocks))
    return y[0] if kblocks == 1 else y


def matmul(x_MK: jax.Array, w_LKN: jax.Array, layer, kblocks: int = 1) -> jax.Array:
    """x @ w[layer], the layer read where it lies in the stack [L, K, N]: float32 [M, N] (with kblocks > 1, the
    partial products over each block of K: [kblocks, M, N])."""
    return grouped_matmul(x_MK, w_LKN, layer, jnp.full((1,), x_MK.shape[0], jnp.int32), kblocks)


def head_matmul(x_BHK: jax.Array, w_LAHX: jax.Array, layer, offset: int, width: int, contract: str) -> jax.Array:
    """Per head h, x[:, h] times columns [offset, offset + width) of layer `layer` of w [L, A, H, X], read in
    place: contract "A" (x's last dim is A; W_UV) -> [B, H, width], or "B" (x's last dim is width; W_UK, the
    columns transposed) -> [B, H, A]. float32 out; A and width multiples of 16."""
    B, H = x_BHK.shape[:2]
    n = width if contract == "A" else w_LAHX.shape[1]
    call = _call(HEAD_TARGET, jax.ShapeDtypeStruct((B, H, n), jnp.float32))
    return call(x_BHK, w_LAHX, jnp.asarray(layer, jnp.int32), offset=int(offset), width=int(width),
                contract_a=int(contract == "A"))


def mla_decode(q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, seq_lens_B, *, softmax_scale) -> jax.Array:
    """MLA's absorbed decode (`jaxdp.model.mla.mla_decode_xla`'s result, float32): each row's heads against its
    first seq_lens_B[b] cache entries, read where they lie in the pages of page_table_BN[b]; rows of no length
    give zeros. The latent width a multiple of 64, the rope's of 16."""
    B, H, L = q_latent_BHL.shape
    call = _call(DECODE_TARGET, jax.ShapeDtypeStruct((B, H, L), jnp.float32))
    return call(q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN.astype(jnp.int32), seq_lens_B.astype(jnp.int32),
                scale=np.float32(softmax_scale))


def cache_write(cache_NK: jax.Array, slots_T: jax.Array, rows_TK: jax.Array) -> jax.Array:
    """The cache [..., K] (N slots: its leading dims flattened) with rows_TK written into slots slots_T (a slot
    outside [0, N) dropped), in place: the result aliases the cache, so only the rows' bytes move (XLA:CPU's
    scatter into a bf16 cache converts the whole cache to float32 and back). Rows cast to the cache's dtype."""
    call = jax.ffi.ffi_call(WRITE_TARGET, jax.ShapeDtypeStruct(cache_NK.shape, cache_NK.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    if not available():
        raise RuntimeError("jaxdp's native CPU kernels are not built on this machine (see the log): use XLA's scatter")
    return call(cache_NK, slots_T.astype(jnp.int32), rows_TK.astype(cache_NK.dtype))


def dense_matmul(x_MK: jax.Array, w_KN: jax.Array) -> jax.Array:
    """x @ w accumulated and returned in float32 (a weight held whole, the LM head): on a CPU by
    `grouped_matmul` where the kernels are built (XLA:CPU's one-row products read at half the machine's
    bandwidth), elsewhere by XLA; differentiable (the derivative is XLA's product's)."""
    def xla(x, w):
        return jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32)

    if not takes(x_MK, w_KN):
        return xla(x_MK, w_KN)

    @jax.custom_jvp
    def product(x, w):
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        return jax.lax.platform_dependent(x, cpu=lambda x: grouped_matmul(x, w, 0, sizes), default=lambda x: xla(x, w))

    product.defjvp(lambda primals, tangents: jax.jvp(xla, primals, tangents))
    return product(x_MK, w_KN)
