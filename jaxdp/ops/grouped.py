"""A grouped matmul by blocks of rows, in plain XLA: what `lax.ragged_dot` computes, without its expansion.

`lax.ragged_dot(x [M, K], w [E, K, N], sizes [E])` multiplies each group of consecutive rows by its own
matrix. XLA (the CPU's lowering, and XLA:GPU's default rewrite) expands it into one zero-padded product per
group over every row: [M, E * N] of temporaries, 112 GiB per device for DeepSeek-V3's EP extend step of 4,096
rows a rank and 896 GiB under moe=tp (`python -m jaxdp.plan --compile`, docs/plan.md). Here every group is
padded to whole blocks of `block` rows, so each block belongs to one group, and a loop over the blocks in
use multiplies [block, K] by that group's [K, N]: the temporaries are the padded rows and their results
(M + E * block rows at most), and the work the rows that exist, plus under one block of padding per group.

`--moe-runner-backend blocked` runs the routed experts this way (bf16 and FP8 experts, and NVFP4 ones
dequantized per layer); `jaxdp.ops.experts` picks it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

MAX_BLOCK = 128  # rows per block at most (a GPU's tile); fewer when the groups are small


def block_rows(rows: int, groups: int) -> int:
    """The block size for `rows` rows over `groups` groups: the power of two nearest the mean group (8 to
    MAX_BLOCK), so that padding (under a block per group) stays about the size of the rows themselves."""
    mean = max(1, -(-rows // max(groups, 1)))
    return max(8, min(MAX_BLOCK, 1 << (mean - 1).bit_length()))


def grouped_matmul(x_MK: jax.Array, w_EKN: jax.Array, sizes_E: jax.Array, *, block: int | None = None,
                   preferred_element_type=jnp.float32, layer: jax.Array | None = None) -> jax.Array:
    """x's rows, sorted by group (group e: the next sizes_E[e] rows; rows after the last group belong to
    none and give zeros), each times its group's w[e]: [M, N] in `preferred_element_type`, as
    `lax.ragged_dot(x, w, sizes, preferred_element_type=...)`.

    With `layer` (a traced int32 scalar), w_EKN is a whole layer stack [L, E, K, N] and the groups multiply
    layer `layer`'s matrices, each block slicing its own matrix out of the stack: the layer's experts are
    never copied out as a whole (XLA:CPU copies a dynamic slice before a product reads it, so slicing the
    layer first would write and read again every expert of the layer at every step)."""
    M, K = x_MK.shape
    E, _, N = w_EKN.shape[-3:]
    block = block or block_rows(M, E)
    nblocks = -(-M // block) + E  # each group wastes less than one block
    padded = nblocks * block
    sizes = sizes_E.astype(jnp.int32)
    ends = jnp.cumsum(sizes)  # in sorted rows
    blocks_E = (sizes + block - 1) // block
    block_ends = jnp.cumsum(blocks_E)
    rows = jnp.arange(M, dtype=jnp.int32)
    group_M = _count_at_or_below(ends, M)  # E: in no group
    in_group = group_M < E
    g = jnp.minimum(group_M, E - 1)
    pos_M = (block_ends[g] - blocks_E[g]) * block + rows - (ends[g] - sizes[g])
    pos_M = jnp.where(in_group, pos_M, padded)  # past the end: dropped below
    x_pad = jnp.zeros((padded, K), x_MK.dtype).at[pos_M].set(x_MK, mode="drop")
    group_of_block = jnp.minimum(_count_at_or_below(block_ends, nblocks), E - 1)

    def one(b, out):
        xb = lax.dynamic_slice_in_dim(x_pad, b * block, block)
        if layer is None:
            wb = lax.dynamic_index_in_dim(w_EKN, group_of_block[b], keepdims=False)
        else:
            wb = lax.dynamic_slice(w_EKN, (layer, group_of_block[b], 0, 0), (1, 1, K, N))[0, 0]
        yb = jnp.dot(xb, wb, preferred_element_type=preferred_element_type)
        return lax.dynamic_update_slice_in_dim(out, yb, b * block, 0)

    # zeros that vary over the mesh axes the body's result varies over (inside shard_map a loop's carry keeps
    # one type): a select that never takes the operands' value, which XLA folds away
    probe = (x_pad[0, 0].astype(preferred_element_type) + w_EKN.reshape(-1)[0].astype(preferred_element_type)
             + group_of_block[0].astype(preferred_element_type))
    out = jnp.where(False, probe, jnp.zeros((padded, N), preferred_element_type))
    out = lax.fori_loop(0, block_ends[-1], one, out)  # the blocks in use only
    return jnp.where(in_group[:, None], out[jnp.minimum(pos_M, padded - 1)], 0).astype(preferred_element_type)


def _count_at_or_below(ends: jax.Array, n: int) -> jax.Array:
    """For i in 0..n-1, how many of `ends` (non-decreasing, each <= n) are <= i: searchsorted(ends, i,
    side="right"), as a scatter and a running sum (a binary search compiles into a loop of its own)."""
    marks = jnp.zeros(n + 1, jnp.int32).at[ends].add(1)
    return jnp.cumsum(marks)[:n]
