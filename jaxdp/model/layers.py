"""Small building blocks: RMSNorm, DeepSeek rope (with YaRN), the SwiGLU MLP.

Weights are stored as the einsums read them (`w_DF` maps D -> F); the loader transposes torch's
[out, in] Linear weights once. Each is created with its logical axes (`param`), which
`jaxdp.parallel.sharding` maps to the mesh under a layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp import native
from jaxdp.config import ModelConfig
from jaxdp.model.fp8 import weight
from jaxdp.model.params import AXES, axes_of, init_normal, param
from jaxdp.ops.gemm import projection
from jaxdp.ops.rows import row_sum
from jaxdp.ops.stacked import StackedWeight

__all__ = ["AXES", "MLP", "RMSNorm", "apply_rope", "axes_of", "dot", "dot_blocks", "init_normal", "param", "rms_norm",
           "rope_inv_freq", "swiglu"]  # (the weights' declarations live in `jaxdp.model.params`)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype=jnp.float32, axis: str = "embed"):
        self.weight = param(jnp.ones((dim,), dtype), (axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    # (the mean as a fixed tree of sums: XLA:CPU's own reduction of a row depends on the rows beside it)
    x32 = x32 * jax.lax.rsqrt(row_sum(x32 * x32, keepdims=True) / x.shape[-1] + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


# ---- rope --------------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies of the rope dimensions and the cos/sin scale (YaRN's attention factor)."""
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = 1.0 / pos_freqs
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32), 1.0
    factor = float(rs["factor"])
    if rs["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32), 1.0
    # YaRN, as DeepSeek and transformers compute it
    orig = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(x_TNR: jax.Array, positions_T: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotate the rope part of queries [T, H, R] or the shared key [T, 1, R] (DeepSeek's layout).

    With rope_interleave the checkpoint stores rotation pairs interleaved (x0, x1), (x2, x3), ...;
    the output is de-interleaved (all first elements, then all second ones), as transformers does.
    Queries and keys get the same permutation, so their dot products are unchanged.
    """
    inv_freq, attn_factor = rope_inv_freq(cfg)
    freqs_TF = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = (jnp.cos(freqs_TF) * attn_factor)[:, None, :]
    sin = (jnp.sin(freqs_TF) * attn_factor)[:, None, :]
    x = x_TNR.astype(jnp.float32)
    if cfg.rope_interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_TNR.dtype)


# ---- products ----------------------------------------------------------------------------------


def dot(eq: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(eq, x, w) accumulated in float32, returned in x's dtype; x's first axis is the output's first.

    XLA:CPU multiplies bf16 at its speed (AVX512-BF16, more than float32's) only when the product accumulates in
    float32 and has at least two rows: a bf16 result, or a single row, takes a generic loop 10-20x slower. A
    one-row bf16 x is therefore padded with a zero row (a GPU does the same product either way).
    A weight handed whole by the layer scan is multiplied by the projection GEMM (`jaxdp.ops.gemm.projection`,
    by the weight's backend; this product is its xla form)."""
    if isinstance(w, StackedWeight):
        return projection(eq, x, w, dot)
    lhs, out = eq.replace(" ", "").split("->")
    assert lhs[0] == out[0], eq
    pad = x.dtype == jnp.bfloat16 and x.shape[0] == 1
    xp = jnp.concatenate([x, jnp.zeros_like(x)]) if pad else x
    y = jnp.einsum(eq, xp, w, preferred_element_type=jnp.float32)
    return (y[:1] if pad else y).astype(x.dtype)


def dot_blocks(x_TK: jax.Array, w, n_in: int, blocks: int) -> jax.Array:
    """The partial products of x [T, K] by w (its leading n_in dims flattened: [K, N]) over `blocks` contiguous
    blocks of K, each on its own: float32 [blocks, T, N] (the fixed reduction tree's partials,
    `jaxdp.ops.rows.block_sum`). By jaxdp's native product on a CPU (a weight the layer scan handed whole read in
    place; a block's partial has the bits the product of that block alone gives, on whichever device holds it), by
    XLA's elsewhere or for a block-FP8 weight."""
    T, K = x_TK.shape
    stacked = isinstance(w, StackedWeight)
    values = w.values if stacked and w.scales is None and w.cols is None else None
    N = math.prod(w.shape[n_in:])

    def xla(x):
        w_KN = (w.dense() if stacked else w).reshape(K, N)
        return jnp.einsum("tbk,bkn->btn", x.reshape(T, blocks, K // blocks), w_KN.reshape(blocks, K // blocks, N),
                          preferred_element_type=jnp.float32)

    if stacked and values is None or not native.takes(x_TK, values if stacked else w):
        return xla(x_TK)
    stack, layer = (values.reshape(values.shape[0], K, N), w.layer) if stacked else (w.reshape(1, K, N), 0)

    def cpu(x):
        y = native.matmul(x, stack, layer, kblocks=blocks)
        return y[None] if blocks == 1 else y

    return jax.lax.platform_dependent(x_TK, cpu=cpu, default=xla)


# ---- MLP ---------------------------------------------------------------------------------------


def swiglu(x_TD: jax.Array, w_gate_up_D2F: jax.Array, w_down_FD: jax.Array, blocks: int | None = None) -> jax.Array:
    """down(silu(gate(x)) * up(x)); gate and up stored together as [D, 2, F]. With `blocks`, the down projection's
    partial products over that many blocks of F, unsummed: float32 [blocks, T, D] (`dot_blocks`)."""
    h_T2F = dot("td,dkf->tkf", x_TD, w_gate_up_D2F)
    h_TF = jax.nn.silu(h_T2F[:, 0].astype(jnp.float32)) * h_T2F[:, 1].astype(jnp.float32)
    if blocks is not None:
        return dot_blocks(h_TF.astype(x_TD.dtype), w_down_FD, 1, blocks)
    return dot("tf,fd->td", h_TF.astype(x_TD.dtype), w_down_FD)


class MLP(nnx.Module):
    """The SwiGLU feed-forward of the dense layers and of the shared expert (`mlp_axis`: the logical axis of its
    intermediate dim, "dense_mlp" or "shared_mlp", which layouts place apart)."""

    def __init__(self, hidden: int, inter: int, rngs: nnx.Rngs, dtype=jnp.float32, mlp_axis: str = "dense_mlp"):
        self.w_gate_up_D2F = param(init_normal(rngs, (hidden, 2, inter), dtype, hidden), ("embed", "gate_up", mlp_axis))
        self.w_down_FD = param(init_normal(rngs, (inter, hidden), dtype, inter), (mlp_axis, "embed"))

    def __call__(self, x_TD: jax.Array, blocks: int | None = None) -> jax.Array:
        """[T, D]; with `blocks`, the down projection's partial products [blocks, T, D] float32 (`swiglu`)."""
        return swiglu(x_TD, weight(self, "w_gate_up_D2F"), weight(self, "w_down_FD"), blocks)
