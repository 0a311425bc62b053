"""DeepSeek's block-FP8 weights, kept in FP8 on the devices and dequantized next to each matmul.

DeepSeek-V3/R1, Kimi-K2 and GLM-5.x-FP8 checkpoints (`quantization_config.quant_method == "fp8"`) store
every Linear weight of the layers as float8_e4m3fn in torch's [out, in] orientation with a float32
`weight_scale_inv` per 128x128 block: w = w_fp8 * scale_inv[o // 128, i // 128]. jaxdp holds such a
weight as two parameters: the e4m3 values in the einsum layout of its dense twin (`w_q_b_QHK`, ...)
and `{name}_bscale`, the block scales in the same layout, each dimension either blocked (one value per
`block` elements) or whole (one value per element). A torch dimension factored into several of ours
(`q_b_proj`'s H*K rows become H, K) is blocked along its last factor when that is a multiple of the
block, else whole (K=192 is not a multiple of 128: its scales are repeated per element, 4 bytes per
128 weights). The layer stacks and the expert axis are whole.

`weight(module, name)` is how the model reads such a weight: the dense array, or the FP8 values times
their repeated scales in the model's dtype (a temporary of one layer's weight). Inside the layer scan the
Linear weights (FP8_WEIGHTS, FP8 or not) and their scales are handed whole, with the layer index
(`jaxdp.model.stacked`), and `weight` returns a `jaxdp.ops.stacked.StackedWeight` carrying the module's
`gemm_backend` (`--fp8-gemm-backend`): `jaxdp.model.layers.dot` multiplies it by the projection GEMM of
`jaxdp.ops.gemm` (Pallas on a GPU, reading the layer in place, the native kernels or the dequantized layer on
a CPU); any other use (an einsum, a slice) reads the layer, dequantized.
`--quantization fp8` quantizes a bf16 checkpoint at load into the same form (amax / 448 per block).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxdp.model.params import axes_of, param
from jaxdp.ops.stacked import InStack, StackedWeight, dequantize

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_bscale"
# the FP8 weights: (in dims, mid dims, out dims) at the end of the shape, laid out [lead.., in.., mid.., out..]
FP8_WEIGHTS = {
    "w_kv_a_DK": (1, 0, 1), "w_q_a_DQ": (1, 0, 1), "w_q_b_QHK": (1, 0, 2), "w_q_DHK": (1, 0, 2),
    "w_kv_b_LHX": (1, 0, 2), "w_o_HVD": (2, 0, 1), "w_gate_up_D2F": (1, 1, 1), "w_down_FD": (1, 0, 1),
    "w_gate_up_ED2I": (1, 1, 1), "w_down_EID": (1, 0, 1),
}


def group_blocks(dims: tuple[int, ...], block: int) -> list[int]:
    """The block along each of our dims that one torch dim (in or out) was factored into."""
    if len(dims) == 1:
        return [block]
    if dims[-1] % block == 0:
        return [1] * (len(dims) - 1) + [block]
    return [1] * len(dims)


def scale_blocks(name: str, shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Per dimension of the weight `name` of this shape: how many elements one scale covers."""
    n_in, n_mid, n_out = FP8_WEIGHTS[name]
    lead = len(shape) - n_in - n_mid - n_out
    ins, outs = tuple(shape[lead:lead + n_in]), tuple(shape[len(shape) - n_out:])
    return tuple([1] * lead + group_blocks(ins, block) + [1] * n_mid + group_blocks(outs, block))


def scale_shape(name: str, shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    return tuple(-(-d // b) for d, b in zip(shape, scale_blocks(name, shape, block), strict=True))


def weight(module, name: str):
    """The weight `name` of `module` as the matmul takes it: dequantized when held in FP8; a `StackedWeight`
    when the layer scan handed it whole (`jaxdp.model.stacked.InStack`)."""
    held = getattr(module, name)
    scale = getattr(module, name + SCALE_SUFFIX, None)
    values = held.get_value()
    if isinstance(values, InStack):
        backend = getattr(module, "gemm_backend", None)  # --fp8-gemm-backend (`jaxdp.model.quant`)
        if scale is None:
            return StackedWeight(values.stack, None, values.layer, backend=backend)
        return StackedWeight(values.stack, scale.get_value().stack, values.layer, module.fp8_block,
                             jnp.dtype(module.fp8_dtype), backend=backend)
    if scale is None:
        return held[...]
    return dequantize(held[...], scale[...], module.fp8_block, module.fp8_dtype)


def in_place(module) -> tuple[str, ...]:
    """The layers' Linear weights that `module` holds (FP8_WEIGHTS: each read through `weight`), and their block
    scales: the layer scan hands them whole (`jaxdp.model.stacked`), and on a GPU the product reads the layer
    where it lies in the stack."""
    names = [n for n in FP8_WEIGHTS if isinstance(getattr(module, n, None), nnx.Variable)]
    return tuple(names) + tuple(n + SCALE_SUFFIX for n in names if hasattr(module, n + SCALE_SUFFIX))


def quantize(w, blocks: tuple[int, ...], xp=np):
    """(e4m3 values, float32 scales) of w with one scale per block (amax / 448); xp is numpy or jnp."""
    w = w.astype(xp.float32)
    pads = [(0, -d % b) for d, b in zip(w.shape, blocks, strict=True)]
    a = xp.pad(xp.abs(w), pads) if any(p for _, p in pads) else xp.abs(w)
    split = [n for d, b in zip(a.shape, blocks, strict=True) for n in (d // b, b)]
    amax = a.reshape(split).max(axis=tuple(range(1, 2 * w.ndim, 2)))
    scale = xp.maximum(amax, 1e-12) / FP8_MAX
    full = scale
    for ax, b in enumerate(blocks):
        if b > 1:
            full = xp.repeat(full, b, axis=ax)[(slice(None),) * ax + (slice(0, w.shape[ax]),)]
    f8 = ml_dtypes.float8_e4m3fn if xp is np else jnp.float8_e4m3fn
    return (w / full).astype(f8), scale.astype(xp.float32)


def to_fp8(model, block: int, dtype) -> None:
    """Hold every FP8_WEIGHTS weight of the layer stacks as e4m3 values plus block scales, in place
    (quantizing the values the model holds; under nnx.eval_shape this only builds the structure)."""
    for stack in (model.dense_layers, model.moe_layers):
        if stack is None:
            continue
        modules = [stack.attn, stack.ffn, getattr(stack.ffn, "shared", None)]
        for m in (m for m in modules if m is not None):
            for name in FP8_WEIGHTS:
                held = getattr(m, name, None)
                if not isinstance(held, nnx.Param) or hasattr(m, name + SCALE_SUFFIX):
                    continue
                w = held.get_value()
                values, scale = quantize(w, scale_blocks(name, w.shape, block), jnp)
                held.set_value(values)
                # the scales lie as the weight does (one value per block or per element): its logical axes
                setattr(m, name + SCALE_SUFFIX, param(scale, axes_of(held)))
            m.fp8_block = block
            m.fp8_dtype = jnp.dtype(dtype).name


def scale_from_torch(s_OI: np.ndarray, in_dims: tuple[int, ...], out_dims: tuple[int, ...],
                     block: int) -> np.ndarray:
    """A checkpoint's weight_scale_inv [ceil(O/b), ceil(I/b)] -> our scale layout [in.., out..]."""
    def side(s: np.ndarray, axis: int, dims: tuple[int, ...]) -> np.ndarray:
        blocks = group_blocks(dims, block)
        if blocks[-1] == 1:  # whole: one value per element
            s = np.take(s, np.arange(math.prod(dims)) // block, axis=axis)
        new = tuple(-(-d // b) for d, b in zip(dims, blocks, strict=True))
        return s.reshape(s.shape[:axis] + new + s.shape[axis + 1:])

    s = side(side(np.asarray(s_OI, np.float32), 1, in_dims), 0, out_dims)
    n_out = len(out_dims)
    return np.moveaxis(s, list(range(n_out)), list(range(s.ndim - n_out, s.ndim)))


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """DeepSeek's block FP8 in torch's layout: w_fp8 * scale_inv[i // bm, j // bn], float32."""
    bm, bn = block
    w32 = np.asarray(w.view(ml_dtypes.float8_e4m3fn) if w.dtype == np.uint8 else w, np.float32)
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)
    return w32 * s[: w32.shape[0], : w32.shape[1]]
