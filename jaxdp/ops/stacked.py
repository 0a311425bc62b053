"""The operands the ops read where they lie in a layer stack: `InStack` (a parameter's whole stack and the layer)
and `StackedWeight` (a Linear weight so held, plain or block-FP8, and views of some of its columns).

A Pallas (Triton) kernel and a native CPU kernel take whole buffers, so a layer sliced out of its stack is copied
before the kernel reads it; the layer scan (`jaxdp.model.decoder`) hands the kernels' parameters whole instead,
with the layer index, and the kernel indexes the layer itself (`jaxdp.model.stacked` says which parameters).
Read any other way (`param[...]`, `dense()`, an einsum) such an operand is its layer, dequantized.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.fp8_gemm import head_tiles, tiles


class InStack:
    """A parameter's whole stack [L, ...] and the layer the scan is at (a traced int32 scalar)."""

    def __init__(self, stack: jax.Array, layer: jax.Array):
        self.stack, self.layer = stack, layer

    def __getitem__(self, key):
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, keepdims=False)[key]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype


def dequantize(w, scale, block: int, dtype):
    """w (e4m3) times its scales repeated over their blocks (dimensions where the shapes differ)."""
    for ax in range(w.ndim):
        if scale.shape[ax] != w.shape[ax]:
            scale = jnp.repeat(scale, block, axis=ax, total_repeat_length=scale.shape[ax] * block)
            scale = jax.lax.slice_in_dim(scale, 0, w.shape[ax], axis=ax)
    return (w.astype(jnp.float32) * scale).astype(dtype)


class StackedWeight:
    """One layer's Linear weight, held as the whole stack of values [L, ...], of block-FP8 scales [L, ...] (None:
    a plain weight) and the layer index; `backend` is the projection GEMM's (`--fp8-gemm-backend`, None: the
    platform's default; `jaxdp.ops.gemm.projection` multiplies it). Read any other way (`dense()`, an einsum) it
    is the layer (dequantized to `dtype`). `w[..., a:b]` is a view of columns [a, b) of its last dim (MLA's W_UK
    and W_UV halves of kv_b_proj), which the GEMM multiplies in place too."""

    def __init__(self, values, scales, layer, block: int = 128, dtype=None, cols: tuple[int, int] | None = None,
                 backend: str | None = None):
        self.values, self.scales, self.layer, self.block = values, scales, layer, block
        self.dtype = values.dtype if scales is None else dtype
        self.cols = cols  # a view of columns [start, stop) of the last dim (None: all)
        self.backend = backend

    def like(self, values, scales, layer) -> StackedWeight:
        """This weight (its view, block, dtype and backend) over other arrays: the same layer traced apart."""
        return StackedWeight(values, scales, layer, self.block, self.dtype, self.cols, self.backend)

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
            view = self.like(self.values, self.scales, self.layer)
            view.cols = (base + start, base + max(start, stop))
            return view
        return self.dense()[key]

    def gemm_operands(self, n_in: int, lead: int = 0):
        """For the kernels: the stack as [L, *lead, K, N] (K: the first `n_in` dims after the `lead` ones,
        flattened), its scales as [L, *lead, K / 128, S] with the scale column of each of the N columns (None,
        None for a plain weight); None where K is not a multiple of 128 or the scales do not block it by 128
        (the kernels' K tile), or for a view of some columns."""
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
        rows = scale_index(ins, s_ins, self.block)
        if self.block != 128 or not np.array_equal(rows, np.arange(k) // 128):
            return None
        s = self.scales.reshape(L, *lead_dims, k // 128, math.prod(s_outs))
        return w, s, scale_index(outs, s_outs, self.block)

    def head_operands(self, contract: str):
        """For the per-head kernel (`kernels_pallas.fp8_gemm.fp8_head_matmul`) of a weight [A, H, B] (or a view of
        some columns of B): the stack [L, A, H, B], its scales [L, A/128, H, S] and the scale column of each
        column of B (None, None for a plain weight); None where the kernel cannot tile it or the scales do not
        block A by 128."""
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
        return self.values, self.scales, scale_index((b,), (s_b,), self.block)


def scale_index(dims: tuple[int, ...], scale_dims: tuple[int, ...], block: int) -> np.ndarray:
    """For each element of the flattened dims, the flattened index of its scale (a dim whose scale count
    differs from its size is blocked by `block`)."""
    if not dims:
        return np.zeros(1, np.int64)
    idx = np.indices(dims).reshape(len(dims), -1)
    blocks = np.array([1 if s == d else block for d, s in zip(dims, scale_dims, strict=True)])[:, None]
    return np.ravel_multi_index(tuple(idx // blocks), scale_dims)
