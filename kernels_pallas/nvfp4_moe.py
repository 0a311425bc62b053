"""Grouped GEMM for routed experts with NVFP4 weights, dequantized in registers (Pallas, Triton backend).

y[t] = x[t] @ dequant(W_e).T for every row t in expert e's group. Rows arrive sorted by expert;
`group_sizes_E` says how many rows each expert owns, in order. Rows past sum(group_sizes) or past
`num_valid_rows` (padding of a compiled bucket) belong to no tile: they cost nothing and come back zero.

Work is cut into row tiles of `block_m` rows that never straddle two experts (a schedule computed with a
few jnp ops on [E]-sized arrays), times column tiles of `block_n`. The grid has the static worst-case
number of row tiles, cdiv(T, block_m) + min(E, T); tiles past the real count exit at once. Each program
streams its expert's packed weights [block_n, block_k // 2] and E4M3 scales [block_n, block_k // 16] over
K, unpacks the nibbles, multiplies by the block scales and feeds a bf16 (or f32) dot; the per-expert
FP32 scale is applied once to the accumulator. Hopper has no FP4 tensor cores: the win is reading 4.5 bits
per weight instead of 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import words as w16
from kernels_pallas.mla_decode import by_lowering_platform
from kernels_pallas.nvfp4 import BLOCK_K, dequantize_nvfp4, e2m1_decode_arith

# f32 operands get IEEE dots (Triton would use TF32 for DEFAULT); bf16 operands are unaffected.
_EXACT = jax.lax.Precision.HIGHEST


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fit_block(block: int, dim: int) -> int:
    """The largest power of two <= block that divides dim."""
    while block > 1 and dim % block:
        block //= 2
    return block


def effective_group_sizes(group_sizes_E: jax.Array, num_valid_rows) -> jax.Array:
    """Group sizes with every row at or past `num_valid_rows` dropped (None: all rows valid)."""
    sizes = group_sizes_E.astype(jnp.int32)
    if num_valid_rows is None:
        return sizes
    ends = jnp.minimum(jnp.cumsum(sizes), jnp.asarray(num_valid_rows, jnp.int32))
    return jnp.diff(ends, prepend=0)


def _row_limit(num_rows: int, num_valid_rows):
    """Rows at or past this index belong to no group (never past the array itself)."""
    if num_valid_rows is None:
        return num_rows
    return jnp.minimum(jnp.asarray(num_valid_rows, jnp.int32), num_rows)


@functools.partial(jax.jit, static_argnames="compute_dtype")
def nvfp4_grouped_matmul_reference(
    x_TK, packed_ENK2, scales_ENK16, global_scale_E, group_sizes_E, *, num_valid_rows=None,
    compute_dtype=jnp.float32,
) -> jax.Array:
    """Plain jnp (the XLA path): dequantize every expert to `compute_dtype`, then lax.ragged_dot, which
    multiplies the rows of group e by W_e.T and leaves rows past sum(group_sizes) zero."""
    sizes_E = effective_group_sizes(group_sizes_E, _row_limit(x_TK.shape[0], num_valid_rows))
    w_ENK = dequantize_nvfp4(packed_ENK2, scales_ENK16, global_scale_E, compute_dtype)
    y_TN = jax.lax.ragged_dot(
        x_TK.astype(compute_dtype), jnp.swapaxes(w_ENK, 1, 2), sizes_E,
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return y_TN.astype(x_TK.dtype)


def tile_schedule(sizes_E: jax.Array, num_rows: int, block_m: int):
    """Row tiles that never straddle experts: (expert, first row, end row) per tile, and the tile count.

    The arrays have the static worst-case length cdiv(T, block_m) + min(E, T); entries past the count
    are unused (the kernel checks the count first).
    """
    num_experts = sizes_E.shape[0]
    max_tiles = pl.cdiv(num_rows, block_m) + min(num_experts, num_rows)
    tiles_E = (sizes_E + block_m - 1) // block_m
    tile_ends_E = jnp.cumsum(tiles_E)
    row_starts_E = jnp.cumsum(sizes_E) - sizes_E
    tile_ids = jnp.arange(max_tiles, dtype=jnp.int32)
    expert_X = jnp.minimum(jnp.searchsorted(tile_ends_E, tile_ids, side="right"), num_experts - 1)
    local_X = tile_ids - (tile_ends_E - tiles_E)[expert_X]
    start_X = row_starts_E[expert_X] + local_X * block_m
    end_X = jnp.minimum(start_X + block_m, row_starts_E[expert_X] + sizes_E[expert_X])
    num_tiles = tile_ends_E[-1].reshape(1)
    return expert_X.astype(jnp.int32), start_X.astype(jnp.int32), end_X.astype(jnp.int32), num_tiles


def grouped_call(kernel, x_TK, n: int, group_sizes_E, num_valid_rows, leading: tuple, weights: tuple, *,
                 block_m: int, block_n: int, interpret: bool, num_warps: int, num_stages: int, name: str):
    """Launch a grouped GEMM `kernel` over row tiles that never straddle two experts (`tile_schedule`), grid
    (row tiles, N / block_n), y [T, N] in x's dtype. The kernel's operands, each whole: `leading` (the layer
    index, ...), the schedule (expert, first row, end row per tile, the tile count), x [T, K], `weights` and a
    zeros buffer aliased to y (rows in no tile, or at or past `num_valid_rows`, stay zero)."""
    t = x_TK.shape[0]
    sizes_E = effective_group_sizes(group_sizes_E, _row_limit(t, num_valid_rows))
    schedule = tile_schedule(sizes_E, t, block_m)
    operands = (*leading, *schedule, x_TK, *weights, jnp.zeros((t, n), x_TK.dtype))
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t, n), x_TK.dtype),
        grid=(schedule[0].shape[0], n // block_n),
        in_specs=[whole] * len(operands),
        out_specs=whole,
        input_output_aliases={len(operands) - 1: 0},
        interpret=interpret,
        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
    )(*operands)


def _dequant_tile(packed_NK2, scale_NKB, dtype):
    """uint8 [bn, bk/2] + e4m3 [bn, bk/16] -> [bn, bk] (without the per-expert scale), in registers."""
    bn, half_k = packed_NK2.shape
    codes = packed_NK2.astype(jnp.int32)
    low, high = e2m1_decode_arith(codes & 0xF), e2m1_decode_arith(codes >> 4)
    values_NK = jnp.stack([low, high], axis=-1).reshape(bn, 2 * half_k)  # even column = low nibble
    scale_NK = jnp.broadcast_to(
        scale_NKB.astype(jnp.float32)[:, :, None], (bn, scale_NKB.shape[1], BLOCK_K)
    ).reshape(bn, 2 * half_k)
    return (values_NK * scale_NK).astype(dtype)


def _grouped_kernel(
    layer_ref, expert_ref, start_ref, end_ref, count_ref, x_ref, packed_ref, scales_ref, gscale_ref, _zeros_ref,
    y_ref, *, block_m, block_n, block_k, num_k_blocks, packed_words, scales_words,
):
    tile, col = pl.program_id(0), pl.program_id(1)

    @pl.when(tile < count_ref[0])
    def _():
        layer, expert, start, end = layer_ref[0], expert_ref[tile], start_ref[tile], end_ref[tile]
        rows_M = start + jnp.arange(block_m, dtype=jnp.int32)
        valid_M = rows_M < end  # rows past `end` are masked out of every load and store
        cols_N = col * block_n + jnp.arange(block_n, dtype=jnp.int32)
        # Gathers use integer-array indices only (interpret mode cannot mix them with pl.ds slices).
        k_K = jnp.arange(block_k, dtype=jnp.int32)
        k_K2 = jnp.arange(block_k // 2, dtype=jnp.int32)
        k_KB = jnp.arange(block_k // BLOCK_K, dtype=jnp.int32)

        def body(kb, acc_MN):
            x_MK = plgpu.load(
                x_ref.at[rows_M[:, None], (kb * block_k + k_K)[None, :]], mask=valid_M[:, None], other=0
            )
            packed_NK2 = w16.load(packed_ref, (layer, expert, cols_N[:, None], (kb * (block_k // 2) + k_K2)[None, :]),
                                  jnp.uint8, packed_words)
            scale_NKB = w16.load(scales_ref, (layer, expert, cols_N[:, None],
                                              (kb * (block_k // BLOCK_K) + k_KB)[None, :]), jnp.float8_e4m3fn,
                                 scales_words)
            w_NK = _dequant_tile(packed_NK2, scale_NKB, x_MK.dtype)
            return acc_MN + jax.lax.dot_general(
                x_MK, w_NK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=_EXACT
            )

        acc_MN = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
        y_MN = (acc_MN * gscale_ref[layer, expert]).astype(y_ref.dtype)
        plgpu.store(y_ref.at[rows_M[:, None], cols_N[None, :]], y_MN, mask=valid_M[:, None])


@functools.partial(
    jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret", "num_warps", "num_stages", "words")
)
def _grouped_call(x_TK, packed_LENK2, scales_LENK16, global_scale_LE, group_sizes_E, layer, num_valid_rows, *,
                  block_m, block_n, block_k, interpret, num_warps, num_stages, words):
    packed_LENK2, packed_words = w16.operand(packed_LENK2, words)
    scales_LENK16, scales_words = w16.operand(scales_LENK16.astype(jnp.float8_e4m3fn), words)
    kernel = functools.partial(_grouped_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               num_k_blocks=x_TK.shape[1] // block_k, packed_words=packed_words,
                               scales_words=scales_words)
    return grouped_call(kernel, x_TK, packed_LENK2.shape[2], group_sizes_E, num_valid_rows,
                        (jnp.asarray(layer, jnp.int32).reshape(1),),
                        (packed_LENK2, scales_LENK16, global_scale_LE.astype(jnp.float32)), block_m=block_m,
                        block_n=block_n, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                        name="nvfp4_grouped_matmul")

def nvfp4_grouped_matmul(
    x_TK, packed_ENK2, scales_ENK16, global_scale_E, group_sizes_E, layer=None, *, num_valid_rows=None,
    block_m: int = 16, block_n: int = 64, block_k: int = 128, interpret: bool | None = None,
    num_warps: int = 4, num_stages: int = 3, words: bool | None = None,
) -> jax.Array:
    """x [T, K] (rows sorted by expert) times each expert's NVFP4 weight [N, K] -> y [T, N] in x's dtype.

    packed_ENK2 uint8 [E, N, K//2]; scales_ENK16 float8_e4m3fn [E, N, K//16]; global_scale_E f32 [E]
    (weight_scale_2); group_sizes_E int32 [E]. For gate/up pass the fused [E, 2I, H] weight; for down
    [E, H, I]. num_valid_rows (int or traced int32 scalar): rows at or past it return zeros.
    layer (int or traced int32 scalar): the weights are a stack of layers, [L, E, N, K//2], [L, E, N, K//16]
    and [L, E], and layer `layer` is multiplied, read where it lies in the stack (no slice is copied out).
    words: read the packed codes and scales as 16-bit words (`kernels_pallas.words`); None: where an operand
    needs it (2 to 4 GiB).
    """
    if layer is None:
        packed_ENK2, scales_ENK16, global_scale_E = packed_ENK2[None], scales_ENK16[None], global_scale_E[None]
        layer = 0
    t, k = x_TK.shape
    num_experts, n, half_k = packed_ENK2.shape[1:]
    if half_k * 2 != k or scales_ENK16.shape[1:] != (num_experts, n, k // BLOCK_K):
        raise ValueError(
            f"NVFP4 operands do not match x [T={t}, K={k}]: packed {packed_ENK2.shape[1:]} should be "
            f"[E, N, {k // 2}] and scales {scales_ENK16.shape[1:]} should be [E, N, {k // BLOCK_K}] (per layer)."
        )
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not _is_pow2(size):
            raise ValueError(f"{name}={size} must be a power of two.")
    block_n, block_k = fit_block(block_n, n), fit_block(block_k, k)
    if block_k < BLOCK_K:
        raise ValueError(f"K={k} needs a power-of-two divisor of at least {BLOCK_K} (one scale block).")
    call = functools.partial(_grouped_call, block_m=block_m, block_n=block_n, block_k=block_k,
                             num_warps=num_warps, num_stages=num_stages, words=words)
    call = by_lowering_platform(call) if interpret is None else functools.partial(call, interpret=interpret)
    return call(x_TK, packed_ENK2, scales_ENK16, global_scale_E, group_sizes_E, layer, num_valid_rows)
