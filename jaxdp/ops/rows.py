"""Reductions along a row (the last axis) whose result for a row does not depend on the rows beside it.

XLA:CPU picks how it vectorizes a reduction from the whole array's shape, so `jnp.sum(x, -1)` of a row can come out
different, in its last bits, when the array has another number of rows (measured, docs/determinism.md: an RMSNorm
of [T, 256] at T < 16 against T = 256, a log_softmax of [5, 512], a segment_sum of row pairs at every T). Here the
row is summed as a fixed tree of elementwise operations (halves added, the width padded to a power of two), which
IEEE arithmetic computes the same way wherever the row lies: the model's norms and the sampler's logprobs use these,
so a request's logits and logprobs do not depend on what shares its step (--enable-deterministic-inference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _tree(x: jax.Array, op, fill) -> jax.Array:
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.concatenate([x, jnp.full((*x.shape[:-1], width - n), fill, x.dtype)], -1)
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = op(x[..., :half], x[..., half:])
    return x


def row_sum(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """The sum along the last axis, the same for a row whatever the array's other dims (the tree on a CPU; XLA's
    own reduction elsewhere, where the tree's slices would cost a GPU time and memory and buy nothing yet)."""
    out = jax.lax.platform_dependent(x, cpu=lambda x: _tree(x, jnp.add, 0),
                                     default=lambda x: jnp.sum(x, -1, keepdims=True))
    return out if keepdims else out[..., 0]


def row_max(x: jax.Array, keepdims: bool = False) -> jax.Array:
    out = jax.lax.platform_dependent(x, cpu=lambda x: _tree(x, jnp.maximum, -jnp.inf),
                                     default=lambda x: jnp.max(x, -1, keepdims=True))
    return out if keepdims else out[..., 0]


def log_softmax(x: jax.Array) -> jax.Array:
    """jax.nn.log_softmax along the last axis, by `row_sum` and `row_max` (float32 in, float32 out)."""
    shifted = x - jax.lax.stop_gradient(row_max(x, keepdims=True))
    return shifted - jnp.log(row_sum(jnp.exp(shifted), keepdims=True))
