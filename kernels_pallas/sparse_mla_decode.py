"""Sparse absorbed-MLA decode (DeepSeek sparse attention): attention over only the latents the indexer
selected, read straight from the paged cache (Pallas, Triton backend).

Row b attends over the cache rows `slots_BK[b, :num_B[b]]` (flat `page * page_size + offset`; the
indexer's top-k, valid ones first), whatever the context length: the work and the bytes read are bounded
by `index_topk`, not by the context. The math is `kernels_pallas.mla_decode`'s, with the page-table
walk replaced by the selected slots:
    out = softmax(scale * (q_latent . c + q_rope . k_rope)) @ c       over the selected tokens.

Same conventions as `mla_decode`: the 576-wide row as two power-of-two parts (512 + 64), one program per
(block of `block_h` heads, split of the selection, row), an online softmax over blocks of `block_t`
selected tokens gathered by slot, a jnp step combining the splits by log-sum-exp; rows with nothing
selected return zeros. The XLA path is `jaxdp.model.mla.sparse_mla_decode_xla` (the model's fallback and
this kernel's reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.mla_decode import _is_pow2, attend_blocks, by_lowering_platform, default_num_splits, run_splits


def _sparse_kernel(num_ref, slots_ref, q_latent_ref, q_rope_ref, kv_ref, out_ref, lse_ref, *,
                   softmax_scale, block_t, blocks_per_split, latent_dim, rope_dim):
    split, row = pl.program_id(1), pl.program_id(2)
    num = num_ref[row]
    q_latent_HC = q_latent_ref[...]
    q_rope_HR = q_rope_ref[...]
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, (num + block_t - 1) // block_t)
    t_T = jnp.arange(block_t, dtype=jnp.int32)

    def rows_of_block(blk):  # the selected tokens' rows of the [pages * page_size, C + R] view
        j_T = blk * block_t + t_T
        return slots_ref[row, j_T], j_T < num

    attend_blocks(rows_of_block, kv_ref, q_latent_HC, q_rope_HR, first, last, out_ref, lse_ref,
                  softmax_scale=softmax_scale, latent_dim=latent_dim, rope_dim=rope_dim)


@functools.partial(
    jax.jit,
    static_argnames=("softmax_scale", "num_splits", "block_h", "block_t", "interpret", "num_warps", "num_stages"),
)
def _sparse_call(q_latent_BHC, q_rope_BHR, kv_cache_PSK, slots_BK, num_B, *, softmax_scale, num_splits, block_h,
                 block_t, interpret, num_warps, num_stages):
    c, r = q_latent_BHC.shape[-1], q_rope_BHR.shape[-1]
    num_pages, page_size, _ = kv_cache_PSK.shape
    k = slots_BK.shape[1]
    num_B = jnp.clip(num_B.astype(jnp.int32), 0, k)
    blocks_per_split = pl.cdiv(pl.cdiv(k, block_t), num_splits)
    padded = num_splits * blocks_per_split * block_t
    # slots past a row's count (and the padding) read row 0 of the cache, masked
    valid_BK = jnp.arange(padded)[None, :] < num_B[:, None]
    slots_BK = jnp.pad(slots_BK.astype(jnp.int32), ((0, 0), (0, padded - k)))
    slots_BK = jnp.where(valid_BK, jnp.clip(slots_BK, 0, num_pages * page_size - 1), 0)
    kernel = functools.partial(_sparse_kernel, softmax_scale=softmax_scale, block_t=block_t,
                               blocks_per_split=blocks_per_split, latent_dim=c, rope_dim=r)
    return run_splits(kernel, "sparse_mla_decode_split", num_B, slots_BK, q_latent_BHC, q_rope_BHR, kv_cache_PSK,
                      num_splits=num_splits, block_h=block_h, interpret=interpret, num_warps=num_warps,
                      num_stages=num_stages)


def sparse_mla_decode(
    q_latent_BHC, q_rope_BHR, kv_cache_PSK, slots_BK, num_B, *, softmax_scale, kv_lora_rank, num_splits=None,
    interpret=None, block_h: int = 16, block_t: int = 32, num_warps: int = 4, num_stages: int = 2,
) -> jax.Array:
    """Sparse absorbed-MLA decode -> out [B, H, C] in q_latent's dtype.

    q_latent_BHC [B, H, C]; q_rope_BHR [B, H, R]; kv_cache_PSK [num_pages, page_size, C + R] (one layer);
    slots_BK int32 [B, K]: the selected cache rows (page * page_size + offset), the valid ones first;
    num_B int32 [B]: how many of them are valid (0 allowed: zeros). softmax_scale is a Python float. C, R,
    block_h and block_t must be powers of two; num_splits: selection splits (None: fill an H200).
    """
    b, h, c = q_latent_BHC.shape
    r = q_rope_BHR.shape[-1]
    width = kv_cache_PSK.shape[-1]
    if c != kv_lora_rank or width != c + r:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank}, q_latent width {c}, q_rope width {r} and cache width {width} "
            "disagree: the cache row must be kv_lora_rank latent values followed by the rope key."
        )
    for name, size in (("kv_lora_rank", c), ("rope dim", r), ("block_h", block_h), ("block_t", block_t)):
        if not _is_pow2(size):
            raise ValueError(f"{name}={size} must be a power of two for the Pallas sparse MLA kernel.")
    if num_splits is None:
        num_splits = default_num_splits(b, pl.cdiv(h, block_h), pl.cdiv(slots_BK.shape[1], block_t))
    call = functools.partial(_sparse_call, softmax_scale=float(softmax_scale), num_splits=int(num_splits),
                             block_h=block_h, block_t=block_t, num_warps=num_warps, num_stages=num_stages)
    call = by_lowering_platform(call) if interpret is None else functools.partial(call, interpret=interpret)
    out_BHC = call(q_latent_BHC, q_rope_BHR, kv_cache_PSK, slots_BK, num_B)
    return out_BHC.astype(q_latent_BHC.dtype)
