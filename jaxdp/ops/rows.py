"""Reductions along a row (the last axis) whose result for a row does not depend on the rows beside it.

XLA:CPU picks how it vectorizes a reduction from the whole array's shape, so `jnp.sum(x, -1)` of a row can come out
different, in its last bits, when the array has another number of rows (measured, docs/determinism.md: an RMSNorm
of [T, 256] at T < 16 against T = 256, a log_softmax of [5, 512], a segment_sum of row pairs at every T). Here the
row is summed as a fixed tree of elementwise operations (halves added, the width padded to a power of two), which
IEEE arithmetic computes the same way wherever the row lies: the model's norms and the sampler's logprobs use these,
so a request's logits and logprobs do not depend on what shares its step (--enable-deterministic-inference).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FIXED_BLOCKS = 8  # the contraction blocks of a split product under the fixed tree: the largest group of this machine


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


# ---- the fixed reduction tree across devices (--enable-deterministic-inference) ----------------------------------
#
# A product whose contraction is split over devices (o_proj over heads under tp, the experts' and MLPs' down
# projections over their intermediate columns) was summed by an all-reduce over however many devices held the
# pieces, in XLA's order, so two layouts gave other bits. Under the flag such a product is computed as partial
# products over a fixed number of contraction blocks (`fixed_blocks`, whatever the device count: a device holding
# several computes each on its own, `jaxdp.native.grouped_matmul(kblocks=...)`), the blocks' partials are gathered
# (`jaxdp.parallel.places`) and added by `block_sum` in block order: the same arithmetic in every layout.


def fixed_blocks(width: int, devices: int) -> int:
    """The number of contraction blocks of a product `width` wide split over `devices` devices under the fixed tree:
    gcd(width, FIXED_BLOCKS), so every layout whose split divides it (1, 2, 4 or 8 devices for the default model)
    sums the same blocks; raised to a multiple of `devices` (a layout splitting wider sums its own blocks)."""
    return math.lcm(math.gcd(width, FIXED_BLOCKS), devices)


def block_sum(x: jax.Array) -> jax.Array:
    """The sum over the leading axis (the blocks, in order) as a fixed pairwise tree of elementwise adds (the
    blocks padded with zeros to a power of two; block i added to block i + half): the same bits for the same
    blocks whichever devices computed them and however many there were."""
    n = x.shape[0]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.concatenate([x, jnp.zeros((width - n, *x.shape[1:]), x.dtype)])
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]
