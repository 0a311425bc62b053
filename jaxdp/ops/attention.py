"""MLA's absorbed decode over the paged latent cache, dense and sparse (DSA's top-k), with their backends
(`jaxdp.ops.registry`: `mla_decode`, `sparse_mla_decode`, chosen by `--attention-backend`).

The query is already in latent space (q_nope . W_UK); each row attends its sequence's cache entries (latent, then
the roped shared key) and the output is in latent space (the caller applies W_UV):

- xla: `mla_decode_xla` (gathers the leading pages the step's longest row fills, rounded up to a width of
  `decode_widths`) and `sparse_mla_decode_xla` (gathers the selected slots); the reference;
- pallas: `kernels_pallas.mla_decode` and `kernels_pallas.sparse_mla_decode` (compiled on a GPU, interpreted on a
  CPU);
- native (a CPU's): `jaxdp.native.mla_decode`, each row reading its own entries through the page table (no
  gathered copy, no batched products over padding); the sparse decode has no native kernel and runs xla.
The model takes a `DecodeKernels` (`decode_kernels`) or None: the platform's default where the step is lowered
(native on a CPU where it is built, xla elsewhere: `mla_decode_default`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxdp import native
from jaxdp.ops.registry import choose, deterministic_backend
from kernels_pallas.mla_decode import mla_decode as mla_decode_pallas
from kernels_pallas.sparse_mla_decode import sparse_mla_decode as sparse_mla_decode_pallas

NEG_INF = -1e30  # finite, so rows with an empty context stay NaN-free (their output is discarded)
DECODE_WIDTH_TOKENS = 64  # the narrowest context the XLA decode reads; then x2 up to the page table's width


def attend_latents(q_latent_BHL, q_rope_BHR, kv_BXK, valid_BX, softmax_scale, kv_lora_rank):
    """Absorbed attention of each row's query over its cache entries kv_BXK (the valid ones). Both products
    take the entries whole (latent and rope, K wide; the output's rope part is dropped): slicing the latent
    out of the gathered entries would copy them, [B, X, L], at every step."""
    q_BHK = jnp.concatenate([q_latent_BHL, q_rope_BHR.astype(q_latent_BHL.dtype)], -1)
    s_BHX = jnp.einsum("bhk,bxk->bhx", q_BHK, kv_BXK.astype(q_BHK.dtype), preferred_element_type=jnp.float32)
    s_BHX = jnp.where(valid_BX[:, None, :], s_BHX * softmax_scale, NEG_INF)
    p_BHX = jax.nn.softmax(s_BHX, axis=-1)
    o_BHK = jnp.einsum("bhx,bxk->bhk", p_BHX.astype(kv_BXK.dtype), kv_BXK, preferred_element_type=jnp.float32)
    return o_BHK[..., :kv_lora_rank].astype(kv_BXK.dtype)  # (XLA:CPU: bf16 fast only so)


def gather_context(kv_PSK: jax.Array, page_table_BN: jax.Array) -> jax.Array:
    B, N = page_table_BN.shape
    return kv_PSK[page_table_BN].reshape(B, N * kv_PSK.shape[1], kv_PSK.shape[2])


def decode_widths(pages: int, page_size: int) -> list[int]:
    """The page counts the XLA decode may read of a `pages`-wide table: DECODE_WIDTH_TOKENS worth, x2, ...,
    and the whole table."""
    out, n = [], -(-DECODE_WIDTH_TOKENS // page_size)
    while n < pages:
        out.append(n)
        n *= 2
    return out + [pages]


def mla_decode_xla(q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, seq_lens_B, *, softmax_scale,
                   kv_lora_rank):
    """The portable absorbed decode (and the reference for the kernels).

    It gathers and attends only the leading pages the step's longest sequence fills, rounded up to a width of
    `decode_widths` (one branch of a switch each), not the whole page table: a table is as wide as its page
    bucket (4,096 tokens at least, the server's whole context below that), and gathering it whole made a
    decode step's attention grow with the maximum context instead of the step's own lengths."""
    B, N = page_table_BN.shape
    S = kv_PSK.shape[1]

    def attend(n):
        def run(q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, seq_lens_B):
            kv_BCK = gather_context(kv_PSK, page_table_BN[:, :n])
            valid_BC = jnp.arange(n * S)[None, :] < seq_lens_B[:, None]
            return attend_latents(q_latent_BHL, q_rope_BHR, kv_BCK, valid_BC, softmax_scale, kv_lora_rank)
        return run

    widths = decode_widths(N, S)
    args = (q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, seq_lens_B)
    if len(widths) == 1:
        return attend(N)(*args)
    pages_needed = (jnp.max(seq_lens_B) + S - 1) // S
    branch = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < pages_needed)
    return jax.lax.switch(branch, [attend(n) for n in widths], *args)


def mla_decode_native(q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, seq_lens_B, *, softmax_scale,
                      kv_lora_rank):
    """The absorbed decode by `jaxdp.native.mla_decode` where the step is lowered for a CPU and the kernel takes
    the operands (built on this machine; float32 or bf16; the latent a multiple of 64 wide, the rope of 16),
    `mla_decode_xla` otherwise."""
    args = (q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, seq_lens_B)
    kw = dict(softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank)
    if not (kv_lora_rank % 64 == 0 and q_latent_BHL.shape[-1] == kv_lora_rank and q_rope_BHR.shape[-1] % 16 == 0
            and native.takes(q_latent_BHL, q_rope_BHR, kv_PSK)):
        return mla_decode_xla(*args, **kw)

    def cpu(q_latent_BHL):
        o = native.mla_decode(q_latent_BHL, *args[1:], softmax_scale=softmax_scale)
        return o.astype(kv_PSK.dtype)

    return jax.lax.platform_dependent(q_latent_BHL, cpu=cpu, default=lambda q: mla_decode_xla(q, *args[1:], **kw))


def write_rows(cache_NK: jax.Array, slots_T: jax.Array, rows_TK: jax.Array) -> jax.Array:
    """The cache [..., K] (N slots: its leading dims flattened) with rows_TK written into slots slots_T (a slot
    outside [0, N) dropped): XLA's scatter, except for a 2-byte float cache (bf16) where the step is lowered for a
    CPU and the native kernels are built: there `jaxdp.native.cache_write` writes the rows in place, since XLA:CPU
    converts a bf16 scatter's whole operand (the pool of a whole layer stack) to float32 and back at every layer
    of every step."""
    rows_TK = rows_TK.astype(cache_NK.dtype)

    def xla(slots_T):
        flat = cache_NK.reshape(-1, cache_NK.shape[-1])
        return flat.at[slots_T].set(rows_TK, mode="drop").reshape(cache_NK.shape)

    if not (jnp.issubdtype(cache_NK.dtype, jnp.floating) and cache_NK.dtype.itemsize == 2
            and native.takes(cache_NK)):
        return xla(slots_T)
    return jax.lax.platform_dependent(slots_T, cpu=lambda s: native.cache_write(cache_NK, s, rows_TK), default=xla)


def sparse_mla_decode_xla(q_latent_BHL, q_rope_BHR, kv_PSK, slots_BK, num_B, *, softmax_scale, kv_lora_rank):
    """Absorbed decode over the selected latents only: row b reads the cache slots slots_BK[b, :num_B[b]]
    (flat page * page_size + offset; the rest of the row is ignored)."""
    P, S, K = kv_PSK.shape
    kv_BKK = kv_PSK.reshape(P * S, K)[jnp.clip(slots_BK, 0, P * S - 1)]
    valid_BK = jnp.arange(slots_BK.shape[1])[None, :] < num_B[:, None]
    return attend_latents(q_latent_BHL, q_rope_BHR, kv_BKK, valid_BK, softmax_scale, kv_lora_rank)


@dataclasses.dataclass(frozen=True)
class DecodeKernels:
    """The decode kernels of one `--attention-backend` (`name`): called, the dense absorbed-MLA decode over the
    page table; `.sparse`, the DSA decode over the selected latents (the model reads it for layers with a top-k
    selection). batch_invariant (--enable-deterministic-inference): every row of every step, a prompt's as a
    decoder's, is attended by `dense` on its own (`jaxdp.model.mla.MLA.attend_expanded`), so a row's result does
    not depend on the step's other rows, its chunking or a prefix-cache hit."""

    name: str
    dense: Callable
    sparse: Callable
    batch_invariant: bool = False

    def __call__(self, *args, **kwargs):
        return self.dense(*args, **kwargs)


KERNELS = {  # --attention-backend -> (dense decode, sparse decode)
    "xla": (mla_decode_xla, sparse_mla_decode_xla),
    "pallas": (mla_decode_pallas, sparse_mla_decode_pallas),
    "native": (mla_decode_native, sparse_mla_decode_xla),
}


def decode_kernels(backend: str | None, platform: str | None = None, deterministic: bool = False) -> DecodeKernels:
    """The decode kernels of `--attention-backend backend` on `platform` (None: the platform's default;
    `jaxdp.ops.registry.choose` refuses what cannot run here, in one sentence); `deterministic`: the
    batch-invariant ones (`jaxdp.ops.registry.deterministic_backend`), attending every row on its own."""
    if deterministic:
        name = deterministic_backend("mla_decode", backend, platform)
        return DecodeKernels(name, *KERNELS[name], batch_invariant=True)
    name = choose("mla_decode", backend, platform)
    return DecodeKernels(name, *KERNELS[name])


def mla_decode_default(*args, **kwargs):
    """The decode of a step given no kernels: the platform's default where the step is lowered (native on a CPU
    where it is built, xla elsewhere)."""
    return mla_decode_native(*args, **kwargs)
