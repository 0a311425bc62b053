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
(`jaxdp.model.stacked`), and `weight` returns a `StackedWeight`: `jaxdp.model.layers.dot` multiplies it with
a Pallas GEMM on a GPU (`kernels_pallas.fp8_gemm`: FP8 tiles dequantized in registers, the layer read where
it lies in the stack; XLA:GPU neither fuses a multiply by the block scales into its GEMMs nor reads a layer
of a stack in place, docs/gpu-on-paper.md) and as before on a CPU (the layer, dequantized, then the
product); any other use (an einsum, a slice) reads the layer, dequantized.
`--quantization fp8` quantizes a bf16 checkpoint at load into the same form (amax / 448 per block).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxdp.model.stacked import InStack

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


def dequantize(w, scale, block: int, dtype):
    """w (e4m3) times its scales repeated over their blocks (dimensions where the shapes differ)."""
    for ax in range(w.ndim):
        if scale.shape[ax] != w.shape[ax]:
            scale = jnp.repeat(scale, block, axis=ax, total_repeat_length=scale.shape[ax] * block)
            scale = jax.lax.slice_in_dim(scale, 0, w.shape[ax], axis=ax)
    return (w.astype(jnp.float32) * scale).astype(dtype)


def weight(module, name: str):
    """The weight `name` of `module` as the matmul takes it: dequantized when held in FP8; a `StackedWeight`
    when the layer scan handed it whole (`jaxdp.model.stacked.InStack`)."""
    param = getattr(module, name)
    scale = getattr(module, name + SCALE_SUFFIX, None)
    values = param.get_value()
    if isinstance(values, InStack):
        if scale is None:
            return StackedWeight(values.stack, None, values.layer)
        return StackedWeight(values.stack, scale.get_value().stack, values.layer, module.fp8_block,
                             jnp.dtype(module.fp8_dtype))
    if scale is None:
        return param[...]
    return dequantize(param[...], scale[...], module.fp8_block, module.fp8_dtype)


def in_place(module) -> tuple[str, ...]:
    """The layers' Linear weights that `module` holds (FP8_WEIGHTS: each read through `weight`), and their block
    scales: the layer scan hands them whole (`jaxdp.model.stacked`), and on a GPU the product reads the layer
    where it lies in the stack."""
    names = [n for n in FP8_WEIGHTS if isinstance(getattr(module, n, None), nnx.Variable)]
    return tuple(names) + tuple(n + SCALE_SUFFIX for n in names if hasattr(module, n + SCALE_SUFFIX))


class StackedWeight:
    """One layer's Linear weight, held as the whole stack of values [L, ...], of block-FP8 scales [L, ...] (None:
    a plain weight) and the layer index: `dot` multiplies it (a Pallas GEMM reading the layer in place on a GPU,
    the layer, dequantized, on a CPU); read any other way (`dense()`, an einsum) it is the layer (dequantized to
    `dtype`). `w[..., a:b]` is a view of columns [a, b) of its last dim (MLA's W_UK and W_UV halves of kv_b_proj),
    which `dot` multiplies in place too."""

    def __init__(self, values, scales, layer, block: int = 128, dtype=None, cols: tuple[int, int] | None = None):
        self.values, self.scales, self.layer, self.block = values, scales, layer, block
        self.dtype = values.dtype if scales is None else dtype
        self.cols = cols  # a view of columns [start, stop) of the last dim (None: all)

    def _like(self, values, scales, layer) -> StackedWeight:
        return StackedWeight(values, scales, layer, self.block, self.dtype, self.cols)

    @property
    def shape(self) -> tuple[int, ...]:
        full = tuple(self.values.shape[1:])
        return full if self.cols is None else full[:-1] + (self.cols[1] - self.cols[0],)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dense(self):
        w = jax.lax.dynamic_index_in_dim(self.values, self.layer, keepdims=False)
        if self.scales is not None:
            s = jax.lax.dynamic_index_in_dim(self.scales, self.layer, keepdims=False)
            w = dequantize(w, s, self.block, self.dtype)
        return w if self.cols is None else w[..., self.cols[0]:self.cols[1]]

    def __jax_array__(self):
        return self.dense()

    def __getitem__(self, key):
        if (isinstance(key, tuple) and len(key) == 2 and key[0] is Ellipsis and isinstance(key[1], slice)
                and key[1].step in (None, 1)):
            start, stop, _ = key[1].indices(self.shape[-1])
            base = 0 if self.cols is None else self.cols[0]
            view = self._like(self.values, self.scales, self.layer)
            view.cols = (base + start, base + max(start, stop))
            return view
        return self.dense()[key]

    def gemm_operands(self, n_in: int, lead: int = 0):
        """For the kernels: the stack as [L, *lead, K, N] (K: the first `n_in` dims after the `lead` ones,
        flattened), its scales as [L, *lead, K / 128, S] with the scale column of each of the N columns (None,
        None for a plain weight); None where K is not a multiple of 128 or the scales do not block it by 128
        (the kernels' K tile), or for a view of some columns."""
        from kernels_pallas.fp8_gemm import tiles

        shape = self.shape
        ins, outs = shape[lead:lead + n_in], shape[lead + n_in:]
        k, n = math.prod(ins), math.prod(outs)
        L, lead_dims = self.values.shape[0], shape[:lead]
        if self.cols is not None or not tiles(k, n):
            return None
        w = self.values.reshape(L, *lead_dims, k, n)
        if self.scales is None:
            return w, None, None
        sshape = tuple(self.scales.shape[1:])
        s_ins, s_outs = sshape[lead:lead + n_in], sshape[lead + n_in:]
        rows = _scale_index(ins, s_ins, self.block)
        if self.block != 128 or not np.array_equal(rows, np.arange(k) // 128):
            return None
        s = self.scales.reshape(L, *lead_dims, k // 128, math.prod(s_outs))
        return w, s, _scale_index(outs, s_outs, self.block)

    def head_operands(self, contract: str):
        """For the per-head kernel (`kernels_pallas.fp8_gemm.fp8_head_matmul`) of a weight [A, H, B] (or a view of
        some columns of B): the stack [L, A, H, B], its scales [L, A/128, H, S] and the scale column of each
        column of B (None, None for a plain weight); None where the kernel cannot tile it or the scales do not
        block A by 128."""
        from kernels_pallas.fp8_gemm import head_tiles

        if self.ndim != 3:
            return None
        a, width = self.shape[0], self.shape[2]
        b = self.values.shape[3]
        if not head_tiles(a, width, contract):
            return None
        if self.scales is None:
            return self.values, None, None
        s_a, s_h, s_b = self.scales.shape[1:]
        if self.block != 128 or s_a != -(-a // 128) or s_h != self.shape[1]:
            return None
        return self.values, self.scales, _scale_index((b,), (s_b,), self.block)

    def _native(self, xs: str, ws: str, out: str, n_in: int, x):
        """How a CPU multiplies x by this weight (einsum `xs,ws->out`, n_in contracted dims) with `jaxdp.native`,
        reading the layer in place: "gemm" (x's trailing dims contracted with the weight's leading ones,
        "td,dq->tq", all its columns, a multiple of 16 of them), "A" or "B" (a product per head with a weight
        [A, H, X] or a view of some columns of X, contracting A, "bhl,lhv->bhv", or the columns, "bhn,lhn->bhl";
        A and the columns multiples of 16), or None (a block-FP8 weight, another form, no kernels built on this
        machine: `dense_dot`)."""
        from jaxdp import native

        if self.scales is not None:
            return None
        if (n_in and self.cols is None and xs[len(xs) - n_in:] == ws[:n_in] and out == xs[:len(xs) - n_in] + ws[n_in:]
                and math.prod(self.shape[n_in:]) % 16 == 0):
            return "gemm" if native.takes(x, self.values) else None
        if len(ws) == 3 and len(xs) == 3 and xs[-2] == ws[1] and xs[-1] in (ws[0], ws[2]) and (
                out == xs[:-1] + ws[2 if xs[-1] == ws[0] else 0]) and self.shape[0] % 16 == 0 and (
                self.shape[2] % 16 == 0):
            return ("A" if xs[-1] == ws[0] else "B") if native.takes(x, self.values) else None
        return None

    def dot(self, eq: str, x, dense_dot, kernel: bool | None = None, out_dtype=None):
        """einsum(eq, x, self) as `dense_dot` computes it (x's dtype out, or `out_dtype`, float32 accumulation):
        by a Pallas GEMM where the step is lowered for a GPU (kernel None) or always (kernel True: interpret mode
        on a CPU, for tests), else `dense_dot(eq, x, self.dense())`; on a CPU by `jaxdp.native` where it applies
        (`_native`), else `dense_dot` too. The GEMMs: `fp8_matmul` when
        eq contracts x's trailing dims with the weight's leading ones; `fp8_head_matmul` for a product per head
        with a weight [A, H, B] (or a view of columns of B), contracting A ("...ha,ahb->...hb") or B
        ("...hb,ahb->...ha")."""
        out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
        lhs, out = eq.replace(" ", "").split("->")
        xs, ws = lhs.split(",")
        n_in = (len(xs) + len(ws) - len(out)) // 2  # contracted dims
        gemm = None
        if kernel is not False and n_in and xs[len(xs) - n_in:] == ws[:n_in] and out == xs[:len(xs) - n_in] + ws[n_in:]:
            operands = self.gemm_operands(n_in)
            if operands is not None:
                def gemm(x, interpret):
                    from kernels_pallas.fp8_gemm import fp8_matmul

                    w, s, cols = operands
                    y = fp8_matmul(x.reshape(-1, w.shape[1]), w, s, cols, self.layer, interpret=interpret,
                                   out_dtype=out_dtype)
                    return y.reshape(*x.shape[:x.ndim - n_in], *self.shape[n_in:])
        elif kernel is not False and len(ws) == 3 and len(xs) >= 2 and xs[-2] == ws[1] and (
                xs[-1] in (ws[0], ws[2]) and out == xs[:-1] + ws[2 if xs[-1] == ws[0] else 0]):
            contract = "A" if xs[-1] == ws[0] else "B"
            operands = self.head_operands(contract)
            if operands is not None:
                def gemm(x, interpret):
                    from kernels_pallas.fp8_gemm import fp8_head_matmul

                    w, s, cols = operands
                    offset, width = (0, self.shape[2]) if self.cols is None else (self.cols[0], self.shape[2])
                    y = fp8_head_matmul(x.reshape(-1, *x.shape[-2:]), w, s, cols, self.layer, offset=offset,
                                        width=width, contract=contract, interpret=interpret, out_dtype=out_dtype)
                    return y.reshape(*x.shape[:-1], y.shape[-1])

        def dense(x, values, scales, layer):
            return dense_dot(eq, x, self._like(values, scales, layer).dense()).astype(out_dtype)

        cpu, form = dense, self._native(xs, ws, out, n_in, x)
        if form == "gemm":
            def cpu(x, values, scales, layer):  # jaxdp.native: the layer read in place, on a CPU
                from jaxdp import native

                k = math.prod(self.shape[:n_in])
                y = native.matmul(x.reshape(-1, k), values.reshape(values.shape[0], k, -1), layer)
                return y.reshape(*x.shape[:x.ndim - n_in], *self.shape[n_in:]).astype(out_dtype)
        elif form is not None:
            def cpu(x, values, scales, layer):  # per head, the columns read in place
                from jaxdp import native

                offset = 0 if self.cols is None else self.cols[0]
                return native.head_matmul(x, values, layer, offset, self.shape[2], form).astype(out_dtype)

        if gemm is None and cpu is dense:
            return dense(x, self.values, self.scales, self.layer)
        if kernel:
            return gemm(x, None)
        off_cpu = dense if gemm is None else lambda x, *_: gemm(x, False)

        @jax.custom_jvp
        def product(x, values, scales, layer):  # (the kernels have no derivative: training differentiates the
            return jax.lax.platform_dependent(x, cpu=lambda x: cpu(x, values, scales, layer),  # dense form)
                                              default=lambda x: off_cpu(x, values, scales, layer))

        product.defjvp(lambda primals, tangents: jax.jvp(dense, primals, tangents))
        return product(x, self.values, self.scales, self.layer)


def einsum(eq: str, x, w, preferred_element_type=None):
    """jnp.einsum(eq, x, w, preferred_element_type=...) for a weight that may be a `StackedWeight` (which then
    multiplies itself: a Pallas GEMM reading its layer in place where the step is lowered for a GPU, this very
    einsum of the dequantized layer on a CPU)."""
    if not isinstance(w, StackedWeight):
        return jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type)
    out = preferred_element_type or jnp.result_type(x.dtype, w.dtype)
    return w.dot(eq, x, lambda eq, x, w: jnp.einsum(eq, x, w, preferred_element_type=preferred_element_type),
                 out_dtype=out)


def _scale_index(dims: tuple[int, ...], scale_dims: tuple[int, ...], block: int) -> np.ndarray:
    """For each element of the flattened dims, the flattened index of its scale (a dim whose scale count
    differs from its size is blocked by `block`)."""
    if not dims:
        return np.zeros(1, np.int64)
    idx = np.indices(dims).reshape(len(dims), -1)
    blocks = np.array([1 if s == d else block for d, s in zip(dims, scale_dims, strict=True)])[:, None]
    return np.ravel_multi_index(tuple(idx // blocks), scale_dims)


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
    from jaxdp.model.layers import axes_of
    from jaxdp.model.layers import param as declared

    for stack in (model.dense_layers, model.moe_layers):
        if stack is None:
            continue
        modules = [stack.attn, stack.ffn, getattr(stack.ffn, "shared", None)]
        for m in (m for m in modules if m is not None):
            for name in FP8_WEIGHTS:
                param = getattr(m, name, None)
                if not isinstance(param, nnx.Param) or hasattr(m, name + SCALE_SUFFIX):
                    continue
                w = param.get_value()
                values, scale = quantize(w, scale_blocks(name, w.shape, block), jnp)
                param.set_value(values)
                # the scales lie as the weight does (one value per block or per element): its logical axes
                setattr(m, name + SCALE_SUFFIX, declared(scale, axes_of(param)))
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
