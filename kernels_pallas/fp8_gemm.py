"""Block-FP8 GEMMs with the dequantization in registers (Pallas, Triton backend), as SGLang runs DeepSeek's
FP8 checkpoints on GPUs: weight-only, bf16 (or f32) activations, float32 accumulation.

A weight is float8_e4m3fn [K, N] with float32 block scales: one per 128 rows of K (DeepSeek's block) and,
along N, whatever `col_scale_N` says (an int32 [N]: the scale column of each output column; one per 128
columns for a plain block-FP8 weight, one per column where the checkpoint's block was spread over a factored
dimension, `jaxdp.model.fp8`). w[k, n] = w_fp8[k, n] * scale[k // 128, col_scale_N[n]].

Both kernels read a whole stack of layers, [L, K, N] (and [L, Kb, S] scales), with the layer index as an
operand: inside the model's layer scan no layer is sliced out of its stack first (a Triton custom call takes
whole buffers, so XLA would copy the slice).

- `fp8_matmul`: y [M, N] = x [M, K] @ W[layer]. Grid (cdiv(M, block_m), N / block_n); each program streams
  K in steps of 128: an x tile [block_m, 128] (rows past M masked), the FP8 tile [128, block_n], the scale row
  of its columns [block_n], multiplies, casts to x's dtype and accumulates the dot in float32. Without scales
  it multiplies a plain weight read in place from its stack (the MoE's float32 router; `stacked_matmul`).
- `fp8_grouped_matmul`: the routed experts, W [L, E, K, N]; rows sorted by expert, `group_sizes_E` rows each,
  cut into row tiles that never straddle two experts (`kernels_pallas.nvfp4_moe.tile_schedule`: the grid has
  the static worst case cdiv(T, block_m) + min(E, T) row tiles; tiles past the real count exit at once, rows
  in no tile come back zero). Its launch is `kernels_pallas.nvfp4_moe.grouped_call`, shared with the NVFP4 one.
- `fp8_head_matmul`: a product per head with MLA's kv_b_proj [L, A, H, B] (or columns of B: W_UK, W_UV),
  contracting A (W_UV after the absorbed attention) or B (q_nope . W_UK); grid (cdiv(M, block_m), H, N /
  block_n).

Block sizes are powers of two (Triton); block_n is cut to the largest power of two dividing N.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import words as w16
from kernels_pallas.mla_decode import by_lowering_platform
from kernels_pallas.nvfp4_moe import _is_pow2, _row_limit, effective_group_sizes, fit_block, grouped_call

BLOCK_K = 128  # DeepSeek's block: one scale per 128 rows of K
FP8 = jnp.float8_e4m3fn
_EXACT = jax.lax.Precision.HIGHEST  # f32 operands get IEEE dots (Triton would use TF32); bf16 unaffected


MIN_BLOCK_N = 16  # Triton's dot needs tiles of at least 16


def tiles(k: int, n: int, block_n: int = 64) -> bool:
    """Whether a [K, N] weight fits these kernels' tiles: K a multiple of 128, N a multiple of 16."""
    return k % BLOCK_K == 0 and fit_block(block_n, n) >= MIN_BLOCK_N


def block_columns(n: int, block: int = BLOCK_K) -> np.ndarray:
    """col_scale_N of a plain block-FP8 weight: one scale column per `block` columns."""
    return np.arange(n, dtype=np.int32) // block


def dequantize(w_KN, scale_KbS, col_scale_N, dtype):
    """The reference dequantization of one weight: [K, N] in `dtype`."""
    k = w_KN.shape[0]
    s_KN = jnp.repeat(scale_KbS, BLOCK_K, axis=0, total_repeat_length=scale_KbS.shape[0] * BLOCK_K)[:k]
    s_KN = jnp.take(s_KN, jnp.asarray(col_scale_N), axis=1)
    return (w_KN.astype(jnp.float32) * s_KN).astype(dtype)


def fp8_matmul_reference(x_MK, w_LKN, scale_LKbS, col_scale_N, layer):
    """Plain jnp: dequantize layer `layer` of the stack to x's dtype, multiply, float32 accumulation."""
    w_KN = (w_LKN[layer].astype(x_MK.dtype) if scale_LKbS is None else
            dequantize(w_LKN[layer], scale_LKbS[layer], col_scale_N, x_MK.dtype))
    return jnp.dot(x_MK, w_KN, preferred_element_type=jnp.float32, precision=_EXACT).astype(x_MK.dtype)


def fp8_grouped_matmul_reference(x_TK, w_LEKN, scale_LEKbS, col_scale_N, group_sizes_E, layer, *,
                                 num_valid_rows=None):
    """Plain jnp: every expert of the layer dequantized, then lax.ragged_dot (rows in no group: zeros)."""
    sizes_E = effective_group_sizes(group_sizes_E, _row_limit(x_TK.shape[0], num_valid_rows))
    w_EKN = jax.vmap(lambda w, s: dequantize(w, s, col_scale_N, x_TK.dtype))(w_LEKN[layer], scale_LEKbS[layer])
    y = jax.lax.ragged_dot(x_TK, w_EKN, sizes_E, precision=_EXACT, preferred_element_type=jnp.float32)
    return y.astype(x_TK.dtype)


def _tile(x_at, w_at, s_at, rows_M, valid_M, cols_N, scol_N, kb, block_k=BLOCK_K):
    """One K step: the x tile, the weight tile (FP8 dequantized with its scales: `s_at(kb, scale columns)`, a
    [N] row or anything broadcasting to [K, N]; None: a plain weight of any dtype), their product (float32)."""
    k_K = kb * block_k + jnp.arange(block_k, dtype=jnp.int32)
    x_MK = plgpu.load(x_at(rows_M[:, None], k_K[None, :]), mask=valid_M[:, None], other=0)
    w_KN = w_at(k_K[:, None], cols_N[None, :])
    if s_at is not None:  # block FP8 (else a plain weight, any dtype)
        w_KN = w_KN.astype(jnp.float32) * s_at(kb, scol_N).astype(jnp.float32)
    w_KN = w_KN.astype(x_MK.dtype)
    return jax.lax.dot_general(x_MK, w_KN, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=_EXACT)


def _dense_kernel(layer_ref, cols_ref, x_ref, w_ref, s_ref, y_ref, *, num_rows, block_m, block_n, num_k_blocks,
                  scaled, words):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    rows_M = i * block_m + jnp.arange(block_m, dtype=jnp.int32)
    valid_M = rows_M < num_rows
    cols_N = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    scol_N = cols_ref[cols_N]

    def body(kb, acc_MN):
        return acc_MN + _tile(lambda m, k: x_ref.at[m, k], lambda k, n: w16.load(w_ref, (layer, k, n), FP8, words),
                              (lambda kb, s: s_ref[layer, kb, s][None, :]) if scaled else None,
                              rows_M, valid_M, cols_N, scol_N, kb)

    acc_MN = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(y_ref.at[rows_M[:, None], cols_N[None, :]], acc_MN.astype(y_ref.dtype), mask=valid_M[:, None])


def _compiler_params(interpret, num_warps, num_stages):
    return None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret", "num_warps", "num_stages",
                                             "out_dtype", "words"))
def _dense_call(x_MK, w_LKN, scale_LKbS, col_scale_N, layer, *, block_m, block_n, interpret, num_warps,
                num_stages, out_dtype, words):
    m, k = x_MK.shape
    n = w_LKN.shape[2]
    kernel = functools.partial(_dense_kernel, num_rows=m, block_m=block_m, block_n=block_n, num_k_blocks=k // BLOCK_K)
    return _layer_call(kernel, jax.ShapeDtypeStruct((m, n), x_MK.dtype if out_dtype is None else out_dtype),
                       (pl.cdiv(m, block_m), n // block_n), ("stacked_matmul", "fp8_matmul"), layer, col_scale_N,
                       x_MK, w_LKN, scale_LKbS, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                       words=words)


def _layer_call(kernel, out_shape, grid, names, layer, col_scale, x, w_stack, scales, *, interpret, num_warps,
                num_stages, words):
    """Launch a GEMM that reads one layer of a stacked weight in place: its operands whole, the layer index, the
    scale column of each weight column, x, the stack and its scales (for a plain weight, placeholders never read:
    `kernel` gets scaled=False and the first of `names`)."""
    scaled = scales is not None
    if not scaled:
        scales, col_scale = jnp.zeros((1,) * w_stack.ndim, jnp.float32), jnp.zeros((w_stack.shape[-1],), jnp.int32)
    w_stack, words = w16.operand(w_stack, words)
    whole = pl.no_block_spec
    return pl.pallas_call(
        functools.partial(kernel, scaled=scaled, words=words),
        out_shape=out_shape,
        grid=grid,
        in_specs=[whole] * 5,
        out_specs=whole,
        interpret=interpret,
        compiler_params=_compiler_params(interpret, num_warps, num_stages),
        name=names[scaled],
    )(jnp.asarray(layer, jnp.int32).reshape(1), col_scale, x, w_stack, scales.astype(jnp.float32))

def _check(name, x_shape, w_shape, s_shape, col_scale_N, blocks):
    k, n = w_shape[-2:]
    if fit_block(blocks["block_n"], n) < MIN_BLOCK_N:
        raise ValueError(f"{name}: N={n} needs a power-of-two divisor of at least {MIN_BLOCK_N} (Triton's dot).")
    if x_shape[-1] != k or k % BLOCK_K or s_shape[-2] != k // BLOCK_K or len(col_scale_N) != n:
        raise ValueError(f"{name}: x {x_shape}, weight {w_shape}, scales {s_shape} and {len(col_scale_N)} scale "
                         f"columns do not match: K must equal x's last dim, be a multiple of {BLOCK_K}, and the "
                         f"scales be [..., K/{BLOCK_K}, S] with one scale column per output column.")
    for label, size in blocks.items():
        if not _is_pow2(size):
            raise ValueError(f"{label}={size} must be a power of two.")


def fp8_matmul(x_MK, w_LKN, scale_LKbS, col_scale_N, layer=0, *, block_m: int = 64, block_n: int = 64,
               interpret: bool | None = None, num_warps: int = 4, num_stages: int = 3, out_dtype=None,
               words: bool | None = None) -> jax.Array:
    """x [M, K] @ dequant(W[layer]) -> [M, N] in x's dtype (or `out_dtype`; float32 accumulation).

    w_LKN float8_e4m3fn [L, K, N] (or [K, N]: one layer); scale_LKbS float32 [L, K/128, S]; col_scale_N
    int32 [N] (numpy or jax), the scale column of each output column; layer: int or traced int32 scalar.
    scale_LKbS and col_scale_N None: W is a plain weight of any dtype (e.g. the MoE's float32 router), read
    in place from its stack, cast to x's dtype. words: read W as 16-bit words (`kernels_pallas.words`); None:
    where it needs it (2 to 4 GiB of FP8)."""
    if w_LKN.ndim == 2:
        w_LKN, scale_LKbS = w_LKN[None], None if scale_LKbS is None else scale_LKbS[None]
    if scale_LKbS is None:
        col_scale_N = np.zeros(w_LKN.shape[2], np.int32)
    _check("fp8_matmul", x_MK.shape, w_LKN.shape, (*w_LKN.shape[:2], w_LKN.shape[1] // BLOCK_K, 1)
           if scale_LKbS is None else scale_LKbS.shape, col_scale_N, {"block_m": block_m, "block_n": block_n})
    call = functools.partial(_dense_call, block_m=block_m, block_n=fit_block(block_n, w_LKN.shape[2]),
                             num_warps=num_warps, num_stages=num_stages, words=words,
                             out_dtype=None if out_dtype is None else jnp.dtype(out_dtype))
    call = by_lowering_platform(call) if interpret is None else functools.partial(call, interpret=interpret)
    return call(x_MK, w_LKN, scale_LKbS, None if scale_LKbS is None else jnp.asarray(col_scale_N, jnp.int32), layer)


# ---- per-head products (MLA's kv_b_proj) ----------------------------------------------------------------------


def head_weight_reference(w_LAHB, scale_LAbHS, col_scale_B, layer, dtype):
    """Layer `layer` of a per-head weight [A, H, B] in `dtype` (dequantized with its [A/128, H, S] scales)."""
    w_AHB = w_LAHB[layer]
    if scale_LAbHS is None:
        return w_AHB.astype(dtype)
    a = w_AHB.shape[0]
    s_AHS = jnp.repeat(scale_LAbHS[layer], BLOCK_K, axis=0, total_repeat_length=scale_LAbHS.shape[1] * BLOCK_K)[:a]
    s_AHB = jnp.take(s_AHS, jnp.asarray(col_scale_B), axis=2)
    return (w_AHB.astype(jnp.float32) * s_AHB).astype(dtype)


def fp8_head_matmul_reference(x_MHK, w_LAHB, scale_LAbHS, col_scale_B, layer, *, offset: int = 0,
                              width: int | None = None, contract: str = "A", out_dtype=None):
    """Plain jnp: the layer dequantized to x's dtype, its columns [offset, offset + width) of B, multiplied per
    head with float32 accumulation (contract "A": y[m, h, b] = sum_a x[m, h, a] W[a, h, offset + b]; "B":
    y[m, h, a] = sum_b x[m, h, b] W[a, h, offset + b])."""
    if width is None:
        width = x_MHK.shape[2] if contract == "B" else w_LAHB.shape[-1] - offset
    w_AHB = head_weight_reference(w_LAHB, scale_LAbHS, col_scale_B, layer, x_MHK.dtype)[..., offset:offset + width]
    eq = "mha,ahb->mhb" if contract == "A" else "mhb,ahb->mha"
    y = jnp.einsum(eq, x_MHK, w_AHB, preferred_element_type=jnp.float32, precision=_EXACT)
    return y.astype(x_MHK.dtype if out_dtype is None else out_dtype)


def _head_kernel(layer_ref, cols_ref, x_ref, w_ref, s_ref, y_ref, *, num_rows, block_m, block_n, block_k,
                 num_k_blocks, offset, contract_a, scaled, words):
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    rows_M = i * block_m + jnp.arange(block_m, dtype=jnp.int32)
    valid_M = rows_M < num_rows
    n_N = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
    x_at = lambda m, k: x_ref.at[m, h, k]  # noqa: E731
    if contract_a:  # y[m, h, n] = sum_a x[m, h, a] W[a, h, offset + n]: a K tile is one block of scale rows
        scol_N = cols_ref[offset + n_N]
        w_at = lambda k, n: w16.load(w_ref, (layer, k, h, offset + n), FP8, words)  # noqa: E731
        s_at = lambda kb, s: s_ref[layer, kb, h, s][None, :]  # noqa: E731
    else:  # y[m, h, n] = sum_b x[m, h, b] W[n, h, offset + b]: an N tile lies in one block of scale rows
        scol_N = None
        w_at = lambda k, n: w16.load(w_ref, (layer, n, h, offset + k), FP8, words)  # noqa: E731
        s_at = lambda kb, _: s_ref[layer, (j * block_n) // BLOCK_K, h,  # noqa: E731
                                   cols_ref[offset + kb * block_k + jnp.arange(block_k, dtype=jnp.int32)]][:, None]

    def body(kb, acc_MN):
        return acc_MN + _tile(x_at, w_at, s_at if scaled else None, rows_M, valid_M, n_N, scol_N, kb, block_k)

    acc_MN = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
    plgpu.store(y_ref.at[rows_M[:, None], h, n_N[None, :]], acc_MN.astype(y_ref.dtype), mask=valid_M[:, None])


@functools.partial(jax.jit, static_argnames=("n", "offset", "contract_a", "block_m", "block_n", "block_k",
                                             "interpret", "num_warps", "num_stages", "out_dtype", "words"))
def _head_call(x_MHK, w_LAHB, scale_LAbHS, col_scale_B, layer, *, n, offset, contract_a, block_m, block_n,
               block_k, interpret, num_warps, num_stages, out_dtype, words):
    m, h, k = x_MHK.shape
    kernel = functools.partial(_head_kernel, num_rows=m, block_m=block_m, block_n=block_n, block_k=block_k,
                               num_k_blocks=k // block_k, offset=offset, contract_a=contract_a)
    return _layer_call(kernel, jax.ShapeDtypeStruct((m, h, n), out_dtype), (pl.cdiv(m, block_m), h, n // block_n),
                       ("stacked_head_matmul", "fp8_head_matmul"), layer, col_scale_B, x_MHK, w_LAHB, scale_LAbHS,
                       interpret=interpret, num_warps=num_warps, num_stages=num_stages, words=words)

def head_tiles(a: int, width: int, contract: str, block_n: int = 64) -> bool:
    """Whether `fp8_head_matmul` tiles a weight [A, H, B] read over `width` of its B columns: the contracted
    side (A: a multiple of 128, a K tile per scale row block; B: a power-of-two divisor of at least 16) and
    the other one a power-of-two divisor of at least 16 (Triton's dot)."""
    if contract == "A":
        return a % BLOCK_K == 0 and fit_block(block_n, width) >= MIN_BLOCK_N
    return a % BLOCK_K == 0 and fit_block(BLOCK_K, width) >= MIN_BLOCK_N and fit_block(block_n, a) >= MIN_BLOCK_N


def fp8_head_matmul(x_MHK, w_LAHB, scale_LAbHS, col_scale_B, layer=0, *, offset: int = 0, width: int | None = None,
                    contract: str = "A", block_m: int = 64, block_n: int = 64, interpret: bool | None = None,
                    num_warps: int = 4, num_stages: int = 3, out_dtype=None, words: bool | None = None) -> jax.Array:
    """x [M, H, K] times each head's slice of a per-head weight (MLA's kv_b_proj [A, H, B]: A the latent, B the
    nope and value dims), the layer read where it lies in its stack [L, A, H, B], its columns [offset, offset +
    width) of B, FP8 dequantized in registers -> [M, H, N] in x's dtype (or `out_dtype`; float32 accumulation).

    contract "A": y[m, h, b] = sum_a x[m, h, a] W[a, h, offset + b] (K = A, N = width; the absorbed output W_UV);
    contract "B": y[m, h, a] = sum_b x[m, h, b] W[a, h, offset + b] (K = width = x's last dim, N = A; the
    absorbed query, q_nope . W_UK). scale_LAbHS float32 [L, A/128, H, S] with col_scale_B int32 [B] the scale
    column of each column of B (None, None: a plain weight of any dtype). Grid (cdiv(M, block_m), H, N /
    block_n)."""
    if w_LAHB.ndim == 3:
        w_LAHB, scale_LAbHS = w_LAHB[None], None if scale_LAbHS is None else scale_LAbHS[None]
    m, h, k = x_MHK.shape
    a, b = w_LAHB.shape[1], w_LAHB.shape[3]
    width = (b - offset if contract == "A" else k) if width is None else width
    n = width if contract == "A" else a
    if contract not in ("A", "B") or w_LAHB.shape[2] != h or k != (a if contract == "A" else width) or (
            offset + width > b) or (scale_LAbHS is not None and (
            scale_LAbHS.shape[1:3] != (-(-a // BLOCK_K), h) or len(col_scale_B) != b)):
        raise ValueError(f"fp8_head_matmul: x {x_MHK.shape}, weight {w_LAHB.shape}, scales "
                         f"{None if scale_LAbHS is None else scale_LAbHS.shape}, contract {contract!r}, columns "
                         f"[{offset}, {offset + width}) do not match: x is [M, H, K] with K = A (contract 'A') or "
                         f"the width (contract 'B'), the weight [L, A, H, B], the scales [L, A/{BLOCK_K}, H, S] with "
                         f"one scale column per column of B.")
    if not head_tiles(a, width, contract, block_n):
        raise ValueError(f"fp8_head_matmul: A={a} must be a multiple of {BLOCK_K} and the width {width} (and A) have "
                         f"a power-of-two divisor of at least {MIN_BLOCK_N} (Triton's dot).")
    for label, size in (("block_m", block_m), ("block_n", block_n)):
        if not _is_pow2(size):
            raise ValueError(f"{label}={size} must be a power of two.")
    call = functools.partial(_head_call, n=n, offset=offset, contract_a=contract == "A", block_m=block_m,
                             block_n=min(fit_block(block_n, n), BLOCK_K),
                             block_k=BLOCK_K if contract == "A" else fit_block(BLOCK_K, width),
                             num_warps=num_warps, num_stages=num_stages, words=words,
                             out_dtype=jnp.dtype(x_MHK.dtype if out_dtype is None else out_dtype))
    call = by_lowering_platform(call) if interpret is None else functools.partial(call, interpret=interpret)
    return call(x_MHK, w_LAHB, scale_LAbHS, None if scale_LAbHS is None else jnp.asarray(col_scale_B, jnp.int32),
                layer)


def _grouped_kernel(layer_ref, cols_ref, expert_ref, start_ref, end_ref, count_ref, x_ref, w_ref, s_ref,
                    _zeros_ref, y_ref, *, block_m, block_n, num_k_blocks, words):
    tile, col = pl.program_id(0), pl.program_id(1)

    @pl.when(tile < count_ref[0])
    def _():
        layer, expert, start, end = layer_ref[0], expert_ref[tile], start_ref[tile], end_ref[tile]
        rows_M = start + jnp.arange(block_m, dtype=jnp.int32)
        valid_M = rows_M < end
        cols_N = col * block_n + jnp.arange(block_n, dtype=jnp.int32)
        scol_N = cols_ref[cols_N]

        def body(kb, acc_MN):
            return acc_MN + _tile(lambda m, k: x_ref.at[m, k],
                                  lambda k, n: w16.load(w_ref, (layer, expert, k, n), FP8, words),
                                  lambda kb, s: s_ref[layer, expert, kb, s][None, :], rows_M, valid_M, cols_N,
                                  scol_N, kb)

        acc_MN = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(y_ref.at[rows_M[:, None], cols_N[None, :]], acc_MN.astype(y_ref.dtype), mask=valid_M[:, None])


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret", "num_warps", "num_stages", "words"))
def _grouped_call(x_TK, w_LEKN, scale_LEKbS, col_scale_N, group_sizes_E, layer, num_valid_rows, *, block_m,
                  block_n, interpret, num_warps, num_stages, words):
    n = w_LEKN.shape[3]
    w_LEKN, words = w16.operand(w_LEKN, words)
    kernel = functools.partial(_grouped_kernel, block_m=block_m, block_n=block_n,
                               num_k_blocks=x_TK.shape[1] // BLOCK_K, words=words)
    return grouped_call(kernel, x_TK, n, group_sizes_E, num_valid_rows,
                        (jnp.asarray(layer, jnp.int32).reshape(1), col_scale_N),
                        (w_LEKN, scale_LEKbS.astype(jnp.float32)), block_m=block_m, block_n=block_n,
                        interpret=interpret, num_warps=num_warps, num_stages=num_stages, name="fp8_grouped_matmul")

def fp8_grouped_matmul(x_TK, w_LEKN, scale_LEKbS, col_scale_N, group_sizes_E, layer=0, *, num_valid_rows=None,
                       block_m: int = 16, block_n: int = 64, interpret: bool | None = None, num_warps: int = 4,
                       num_stages: int = 3, words: bool | None = None) -> jax.Array:
    """x [T, K] (rows sorted by expert) times each expert's dequant(W[layer, e]) [K, N] -> [T, N] in x's dtype.

    w_LEKN float8_e4m3fn [L, E, K, N] (or [E, K, N]); scale_LEKbS float32 [L, E, K/128, S]; col_scale_N int32
    [N]; group_sizes_E int32 [E]; num_valid_rows (int or traced int32): rows at or past it come back zero."""
    if w_LEKN.ndim == 3:
        w_LEKN, scale_LEKbS = w_LEKN[None], scale_LEKbS[None]
    _check("fp8_grouped_matmul", x_TK.shape, w_LEKN.shape, scale_LEKbS.shape, col_scale_N,
           {"block_m": block_m, "block_n": block_n})
    call = functools.partial(_grouped_call, block_m=block_m, block_n=fit_block(block_n, w_LEKN.shape[3]),
                             num_warps=num_warps, num_stages=num_stages, words=words)
    call = by_lowering_platform(call) if interpret is None else functools.partial(call, interpret=interpret)
    return call(x_TK, w_LEKN, scale_LEKbS, jnp.asarray(col_scale_N, jnp.int32), group_sizes_E, layer,
                num_valid_rows)
