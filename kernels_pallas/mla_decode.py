"""Absorbed-MLA decode attention over a paged latent cache (Pallas, Triton backend), and its jnp reference.

A cached token is one row of C + R values: the latent c (C = kv_lora_rank, 512) and the roped key (R = 64).
With the up-projections absorbed into the query and the output, attention for a head is
    out = softmax(scale * (q_latent . c + q_rope . k_rope)) @ c        (the value is the latent itself).

The kernel keeps the 576-wide row as two power-of-two parts (512 + 64, as Triton wants), runs one program
per (block of `block_h` heads, context split, row) and an online softmax over blocks of `block_t` tokens
gathered through the page table. Each split writes its unnormalised partial result and log-sum-exp; a jnp
step combines the splits. Rows with length 0, and rows at or past `num_valid_rows`, do no work and return
zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# f32 operands get IEEE dots (Triton would use TF32 for DEFAULT); bf16 operands are unaffected.
_EXACT = jax.lax.Precision.HIGHEST


def default_interpret() -> bool:
    return jax.default_backend() == "cpu"


def by_lowering_platform(call):
    """`call(*args, interpret=...)` with interpret chosen when the caller is lowered: interpret mode for a CPU,
    Triton for a GPU. The devices the step is compiled for decide (a mesh of simulated GPUs on a CPU machine,
    `jaxdp.planner`), not `jax.default_backend()`; only the chosen branch is lowered."""
    def chosen(*args):
        return jax.lax.platform_dependent(*args, cpu=functools.partial(call, interpret=True),
                                          default=functools.partial(call, interpret=False))
    return chosen


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _masked_lengths(lengths_B: jax.Array, num_valid_rows) -> jax.Array:
    lengths_B = lengths_B.astype(jnp.int32)
    if num_valid_rows is None:
        return lengths_B
    rows_B = jnp.arange(lengths_B.shape[0], dtype=jnp.int32)
    return jnp.where(rows_B < jnp.asarray(num_valid_rows, jnp.int32), lengths_B, 0)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "kv_lora_rank"))
def mla_decode_reference(
    q_latent_BHC, q_rope_BHR, kv_cache_PSK, page_table_BN, lengths_B, *, softmax_scale, kv_lora_rank,
    num_valid_rows=None,
) -> jax.Array:
    """Plain jnp: gather every row's pages, mask past its length, softmax, weight the latents."""
    c = kv_lora_rank
    b = q_latent_BHC.shape[0]
    kv_BTK = kv_cache_PSK[page_table_BN].reshape(b, -1, kv_cache_PSK.shape[-1])
    f32 = dict(precision="highest", preferred_element_type=jnp.float32)
    scores_BHT = jnp.einsum("bhc,btc->bht", q_latent_BHC, kv_BTK[..., :c], **f32)
    scores_BHT += jnp.einsum("bhr,btr->bht", q_rope_BHR, kv_BTK[..., c:], **f32)
    lengths_B = _masked_lengths(lengths_B, num_valid_rows)
    valid_BT = jnp.arange(kv_BTK.shape[1])[None, :] < lengths_B[:, None]
    scores_BHT = jnp.where(valid_BT[:, None, :], scores_BHT * softmax_scale, -jnp.inf)
    probs_BHT = jax.nn.softmax(scores_BHT, axis=-1, where=valid_BT[:, None, :])
    probs_BHT = jnp.where(valid_BT[:, None, :], probs_BHT, 0.0)  # a row of length 0 gives zeros
    out_BHC = jnp.einsum("bht,btc->bhc", probs_BHT, kv_BTK[..., :c].astype(jnp.float32), **f32)
    return out_BHC.astype(q_latent_BHC.dtype)


def _split_kernel(
    lengths_ref, page_table_ref, q_latent_ref, q_rope_ref, kv_ref, out_ref, lse_ref, *,
    softmax_scale, page_size, block_t, blocks_per_split, latent_dim, rope_dim,
):
    split, row = pl.program_id(1), pl.program_id(2)
    length = lengths_ref[row]
    q_latent_HC = q_latent_ref[...]
    q_rope_HR = q_rope_ref[...]
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, (length + block_t - 1) // block_t)
    t_T = jnp.arange(block_t, dtype=jnp.int32)

    def rows_of_block(blk):
        tok_T = blk * block_t + t_T
        page_T = page_table_ref[row, tok_T // page_size]
        return page_T * page_size + tok_T % page_size, tok_T < length

    attend_blocks(rows_of_block, kv_ref, q_latent_HC, q_rope_HR, first, last, out_ref, lse_ref,
                  softmax_scale=softmax_scale, latent_dim=latent_dim, rope_dim=rope_dim)


def attend_blocks(rows_of_block, kv_ref, q_latent_HC, q_rope_HR, first, last, out_ref, lse_ref, *,
                  softmax_scale, latent_dim, rope_dim):
    """The online softmax over cache blocks first..last-1, shared by the dense and the sparse kernel:
    `rows_of_block(blk)` gives the block's rows of the [pages * page_size, C + R] view and which are valid;
    writes the normalised output and its log-sum-exp (-inf and zeros when no token was valid)."""
    block_h = q_latent_HC.shape[0]
    c_C = jnp.arange(latent_dim, dtype=jnp.int32)
    r_R = latent_dim + jnp.arange(rope_dim, dtype=jnp.int32)

    def body(blk, carry):
        max_H, sum_H, acc_HC = carry
        cache_row_T, valid_T = rows_of_block(blk)
        latent_TC = kv_ref[cache_row_T[:, None], c_C[None, :]]
        rope_TR = kv_ref[cache_row_T[:, None], r_R[None, :]]
        dot_kw = dict(dimension_numbers=(((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                      precision=_EXACT)
        scores_HT = jax.lax.dot_general(q_latent_HC, latent_TC, **dot_kw)
        scores_HT += jax.lax.dot_general(q_rope_HR, rope_TR, **dot_kw)
        scores_HT = jnp.where(valid_T[None, :], scores_HT * softmax_scale, -jnp.inf)
        new_max_H = jnp.maximum(max_H, jnp.max(scores_HT, axis=1))  # finite: a block has a valid token
        rescale_H = jnp.exp(max_H - new_max_H)
        probs_HT = jnp.exp(scores_HT - new_max_H[:, None])
        sum_H = sum_H * rescale_H + jnp.sum(probs_HT, axis=1)
        acc_HC = acc_HC * rescale_H[:, None] + jax.lax.dot_general(
            probs_HT.astype(latent_TC.dtype), latent_TC, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32, precision=_EXACT,
        )
        return new_max_H, sum_H, acc_HC

    init = (
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.zeros((block_h, latent_dim), jnp.float32),
    )
    max_H, sum_H, acc_HC = jax.lax.fori_loop(first, last, body, init)
    has_tokens_H = sum_H > 0
    out_ref[...] = acc_HC / jnp.where(has_tokens_H, sum_H, 1.0)[:, None]
    lse_ref[...] = jnp.where(has_tokens_H, max_H + jnp.log(jnp.where(has_tokens_H, sum_H, 1.0)), -jnp.inf)


def combine_splits(out_BSHC: jax.Array, lse_BSH: jax.Array) -> jax.Array:
    """Merges per-split normalised outputs by their log-sum-exp; all-empty rows give zeros."""
    max_BH = jnp.max(lse_BSH, axis=1)
    safe_max_BH = jnp.where(jnp.isfinite(max_BH), max_BH, 0.0)
    weight_BSH = jnp.exp(lse_BSH - safe_max_BH[:, None, :])  # exp(-inf) = 0 for empty splits
    total_BH = jnp.sum(weight_BSH, axis=1)
    out_BHC = jnp.einsum("bsh,bshc->bhc", weight_BSH, out_BSHC)
    return out_BHC / jnp.where(total_BH > 0, total_BH, 1.0)[..., None]


def default_num_splits(batch: int, head_blocks: int, context_blocks: int, num_sms: int = 132) -> int:
    """Enough (row, head block, split) programs to fill the GPU about twice, at most one split a block."""
    wanted = pl.cdiv(2 * num_sms, batch * head_blocks)
    return int(max(1, min(wanted, context_blocks, 32)))


@functools.partial(
    jax.jit,
    static_argnames=("softmax_scale", "kv_lora_rank", "num_splits", "block_h", "block_t", "interpret",
                     "num_warps", "num_stages"),
)
def _mla_call(q_latent_BHC, q_rope_BHR, kv_cache_PSK, page_table_BN, lengths_B, num_valid_rows, *,
              softmax_scale, kv_lora_rank, num_splits, block_h, block_t, interpret, num_warps, num_stages):
    c, r = q_latent_BHC.shape[-1], q_rope_BHR.shape[-1]
    num_pages, page_size, _ = kv_cache_PSK.shape
    capacity = page_table_BN.shape[1] * page_size  # a longer length reads only what the table holds
    lengths_B = jnp.minimum(_masked_lengths(lengths_B, num_valid_rows), capacity)
    pages_per_block = block_t // page_size
    context_blocks = pl.cdiv(page_table_BN.shape[1], pages_per_block)
    blocks_per_split = pl.cdiv(context_blocks, num_splits)
    # Pad the table to whole splits of whole blocks; pages past a row's length read page 0 (masked).
    padded_pages = num_splits * blocks_per_split * pages_per_block
    table_BN = jnp.pad(page_table_BN.astype(jnp.int32), ((0, 0), (0, padded_pages - page_table_BN.shape[1])))
    pages_used_B = (lengths_B + page_size - 1) // page_size
    table_BN = jnp.where(jnp.arange(padded_pages)[None, :] < pages_used_B[:, None], table_BN, 0)
    kernel = functools.partial(
        _split_kernel, softmax_scale=softmax_scale, page_size=page_size, block_t=block_t,
        blocks_per_split=blocks_per_split, latent_dim=c, rope_dim=r,
    )
    return run_splits(kernel, "mla_decode_split", lengths_B, table_BN, q_latent_BHC, q_rope_BHR, kv_cache_PSK,
                      num_splits=num_splits, block_h=block_h, interpret=interpret, num_warps=num_warps,
                      num_stages=num_stages)


def run_splits(kernel, name: str, counts_B, where_BX, q_latent_BHC, q_rope_BHR, kv_cache_PSK, *, num_splits: int,
               block_h: int, interpret: bool, num_warps: int, num_stages: int) -> jax.Array:
    """The launch both decode kernels share: one program per (block of `block_h` heads, split, row), head
    blocks fastest so the programs that read the same cache blocks run together (L2). `counts_B` and
    `where_BX` (lengths and page table, or counts and selected slots) and the cache, viewed as
    [pages * page_size, C + R] rows, are read whole; each program writes its split's normalised output and
    log-sum-exp, and `combine_splits` merges them -> [B, H, C]."""
    b, h, c = q_latent_BHC.shape
    r = q_rope_BHR.shape[-1]
    h_pad = pl.cdiv(h, block_h) * block_h  # the dot wants >= 16 rows: pad heads with zero queries
    q_latent_BHC = jnp.pad(q_latent_BHC, ((0, 0), (0, h_pad - h), (0, 0)))
    q_rope_BHR = jnp.pad(q_rope_BHR, ((0, 0), (0, h_pad - h), (0, 0)))
    kv_TK = kv_cache_PSK.reshape(-1, c + r)
    out_BSHC, lse_BSH = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((b, num_splits, h_pad, c), jnp.float32),
                   jax.ShapeDtypeStruct((b, num_splits, h_pad), jnp.float32)),
        grid=(h_pad // block_h, num_splits, b),
        in_specs=[
            pl.no_block_spec,
            pl.no_block_spec,
            pl.BlockSpec((None, block_h, c), lambda j, s, i: (i, j, 0)),
            pl.BlockSpec((None, block_h, r), lambda j, s, i: (i, j, 0)),
            pl.no_block_spec,
        ],
        out_specs=(
            pl.BlockSpec((None, None, block_h, c), lambda j, s, i: (i, s, j, 0)),
            pl.BlockSpec((None, None, block_h), lambda j, s, i: (i, s, j)),
        ),
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
    )(counts_B, where_BX, q_latent_BHC, q_rope_BHR, kv_TK)
    return combine_splits(out_BSHC, lse_BSH)[:, :h]


def mla_decode(
    q_latent_BHC, q_rope_BHR, kv_cache_PSK, page_table_BN, lengths_B, *, softmax_scale, kv_lora_rank,
    num_valid_rows=None, num_splits=None, interpret=None, block_h: int = 16, block_t: int | None = None,
    num_warps: int = 4, num_stages: int = 2,
) -> jax.Array:
    """Absorbed-MLA decode over a paged latent cache -> out [B, H, C] in q_latent's dtype.

    q_latent_BHC [B, H, C]; q_rope_BHR [B, H, R]; kv_cache_PSK [num_pages, page_size, C + R] (one
    layer; latent first, roped key last); page_table_BN int32 [B, max_pages]; lengths_B int32 [B]
    (0 allowed; a length past the table's capacity reads only what the table holds). num_valid_rows
    (int or traced int32 scalar): rows at or past it return zeros. softmax_scale is a Python float.
    num_splits: context splits (None: enough programs to fill an H200). C, R and page_size must be
    powers of two; block_t (tokens per inner step, default max(page_size, 32)) a multiple of page_size.
    """
    b, h, c = q_latent_BHC.shape
    r = q_rope_BHR.shape[-1]
    num_pages, page_size, width = kv_cache_PSK.shape
    if c != kv_lora_rank or width != c + r:
        raise ValueError(
            f"kv_lora_rank={kv_lora_rank}, q_latent width {c}, q_rope width {r} and cache width {width} "
            "disagree: the cache row must be kv_lora_rank latent values followed by the rope key."
        )
    block_t = max(page_size, 32) if block_t is None else block_t
    for name, size in (("kv_lora_rank", c), ("rope dim", r), ("page_size", page_size), ("block_h", block_h),
                       ("block_t", block_t)):
        if not _is_pow2(size):
            raise ValueError(f"{name}={size} must be a power of two for the Pallas MLA kernel.")
    if block_t % page_size:
        raise ValueError(f"block_t={block_t} must be a multiple of page_size={page_size}.")
    context_blocks = pl.cdiv(page_table_BN.shape[1] * page_size, block_t)
    if num_splits is None:
        num_splits = default_num_splits(b, pl.cdiv(h, block_h), context_blocks)
    call = functools.partial(
        _mla_call, softmax_scale=float(softmax_scale), kv_lora_rank=kv_lora_rank, num_splits=int(num_splits),
        block_h=block_h, block_t=block_t, num_warps=num_warps, num_stages=num_stages)
    call = by_lowering_platform(call) if interpret is None else functools.partial(call, interpret=interpret)
    out_BHC = call(q_latent_BHC, q_rope_BHR, kv_cache_PSK, page_table_BN, lengths_B, num_valid_rows)
    return out_BHC.astype(q_latent_BHC.dtype)
