"""The four places where "each rank has its own rows" meets "all ranks compute this together".

1. `gather_for_moe`   — before the MoE (and gathered dense layers): MAX_LEN all-gather of padded
                        rows, or the SUM_LEN exact buffer (each rank writes at its offset, then a sum);
2. `return_from_moe`  — after it: reduce-scatter (MAX_LEN), or sum and copy out (SUM_LEN);
3. `agree_on_step`    — before each step, on the host: rows and requests per rank, the decode-bucket
                        vote (AND), "any rank reads a prompt" (OR), who runs an idle batch;
4. `lm_head_logits`   — the LM head: rows to a vocab-split head (gather, then all-gather of logits),
                        the all-to-all form, or the whole head on every rank.
Plus the EP MoE (`dispatch_combine_moe` with a fixed capacity per destination on XLA:CPU,
`ragged_dispatch_combine_moe` moving only the rows that travel on XLA:GPU), where rows leave their rank
inside dispatch and come back inside combine, and no gather or return happens around the MoE.

Everything but `agree_on_step` runs inside the step's shard_map over the mesh ("dp", "tp").
Shape suffixes: T rows of this rank, R gathered rows, B sequences, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdp.model.fp8 import weight
from jaxdp.model.layers import rms_norm
from jaxdp.model.moe import count_choices
from jaxdp.ops.gemm import lm_head_product
from jaxdp.ops.rows import block_sum, fixed_blocks
from jaxdp.parallel.agreement import Agreement, LocalExchange, Proposal, agree_on_step

__all__ = ["Agreement", "LocalExchange", "Proposal", "agree_on_step"]  # (place 3 is in its own JAX-free module)

ALL = ("dp", "tp")


@dataclasses.dataclass(frozen=True)
class GatherSpec:
    mode: str  # "max_len" | "sum_len"
    dp: int
    tp: int
    sum_rows: int = 0  # SUM_LEN buffer rows (static); >= the sum of all ranks' rows



# ---- 1. the gather -----------------------------------------------------------------------------
#
# With tp > 1 inside a group, the group's attention all-reduce is folded into the gather (the article's
# Figure 12): a reduce-scatter inside the group leaves each device a 1/tp chunk of the group's finished
# rows (`MeshComm.attn_to_ffn`), and one gather over all devices assembles the MoE buffer. So the
# gather and the return always run over every device of the world, on chunks of n = ceil(T / tp) rows.


def gather_for_moe(h_nD, valid_n, rows_R, g: GatherSpec):
    """Every rank's rows on every device: returns (h_RD, valid_R)."""
    if g.mode == "max_len":
        h_RD = jax.lax.all_gather(h_nD, ALL, axis=0, tiled=True)
        return h_RD, jax.lax.all_gather(valid_n, ALL, axis=0, tiled=True)
    n, D = h_nD.shape
    buf = jnp.zeros((g.sum_rows + n, D), h_nD.dtype)
    buf = jax.lax.dynamic_update_slice(buf, jnp.where(valid_n[:, None], h_nD, 0), (_chunk_offset(rows_R, n), 0))
    h_RD = jax.lax.psum(buf[: g.sum_rows], ALL)
    return h_RD, jnp.arange(g.sum_rows) < rows_R.sum()


# ---- 2. the return -----------------------------------------------------------------------------


def return_from_moe(y_RD, rows_R, n: int, g: GatherSpec):
    """The sum of every device's partial results, for this device's chunk of its rank's rows: [n, D]."""
    if g.mode == "max_len":
        return jax.lax.psum_scatter(y_RD, ALL, scatter_dimension=0, tiled=True)
    y = jax.lax.psum(y_RD, ALL)
    y = jnp.concatenate([y, jnp.zeros((n, y.shape[1]), y.dtype)])
    return jax.lax.dynamic_slice_in_dim(y, _chunk_offset(rows_R, n), n, axis=0)


def _chunk_offset(rows_R, n: int):
    """Where this device's chunk starts in the exact buffer: its rank's offset plus tp index * n."""
    r = jax.lax.axis_index("dp")
    return jnp.cumsum(rows_R)[r] - rows_R[r] + jax.lax.axis_index("tp") * n


def _chunk_start(rows_R, n: int, g: GatherSpec):
    """Where this device's chunk of rows starts in the gathered rows (either mode)."""
    return jax.lax.axis_index(ALL) * n if g.mode == "max_len" else _chunk_offset(rows_R, n)


# ---- 2'. the return by a fixed tree (--enable-deterministic-inference) --------------------------
#
# Instead of the all-reduce of the devices' partial results (summed in an order that depends on how many devices
# hold the pieces), each device's partial products over its contraction blocks go to the device whose rows they
# are (an all-to-all of the same bytes as the reduce-scatter, times the blocks a device holds), and there the
# blocks of all devices are added by one fixed tree in block order (`jaxdp.ops.rows.block_sum`). A layout with
# the blocks on one device adds the same partials by the same tree: the layouts agree bit for bit.


def return_blocks(y_bRF, rows_R, n: int, g: GatherSpec):
    """This device's partials over its b contraction blocks, for every gathered row [b, R, F] -> every device's
    blocks for this device's chunk of its rank's rows, in block order (device-major): [world * b, n, F]."""
    b, F, world = y_bRF.shape[0], y_bRF.shape[2], g.dp * g.tp
    if g.mode == "max_len":
        send = y_bRF.reshape(b, world, n, F)
    else:  # the chunk of device j of rank r starts at rank r's offset in the exact buffer plus j's tp index * n
        y = jnp.concatenate([y_bRF, jnp.zeros((b, n, F), y_bRF.dtype)], axis=1)
        j = jnp.arange(world)
        start_W = (jnp.cumsum(rows_R) - rows_R)[j // g.tp] + (j % g.tp) * n
        send = jax.vmap(lambda o: jax.lax.dynamic_slice_in_dim(y, o, n, axis=1), out_axes=1)(start_W)
    got = jax.lax.all_to_all(send, ALL, 1, 1, tiled=True)  # [b, world (the sources), n, F]
    return got.transpose(1, 0, 2, 3).reshape(world * b, n, F)


def sum_head_blocks(a_bTD, n: int, tp: int):
    """Attention's o_proj partial products over this device's b blocks of heads [b, T, D] -> the group's sum for
    this device's chunk of n rows [n, D] (tp > 1), by the fixed tree over the group's blocks in head order, as
    the whole group's heads on one device would add them."""
    b, T, D = a_bTD.shape
    a = jnp.pad(a_bTD, ((0, 0), (0, n * tp - T), (0, 0))).reshape(b, tp, n, D)
    got = jax.lax.all_to_all(a, "tp", 1, 1, tiled=True)  # [b, tp (the sources), n, D]
    return block_sum(got.transpose(1, 0, 2, 3).reshape(tp * b, n, D))


def combine_choices(t_TKD, w_TK):
    """A row's expert outputs weighted and added in choice order (the same arithmetic in every layout)."""
    y = w_TK[:, 0, None] * t_TKD[:, 0]
    for k in range(1, t_TKD.shape[1]):
        y = y + w_TK[:, k, None] * t_TKD[:, k]
    return y


def split_blocks(held: int, devices: int) -> int:
    """The contraction blocks of a product whose `held` columns are this device's share of `devices` devices'."""
    return fixed_blocks(held * devices, devices) // devices


# ---- 3. the agreement --------------------------------------------------------------------------
# On the host, before each step, and free of JAX so that the schedulers can import it: jaxdp.parallel.agreement.

# ---- 4. the LM head ----------------------------------------------------------------------------


def lm_head_logits(h_BD, w_DV, mode: str, dp: int, tp: int):
    """Full-vocab float32 logits of this rank's rows [B, V]."""
    if mode == "replicated":
        return lm_head_product(h_BD, w_DV)
    B = h_BD.shape[0]
    h_RD = jax.lax.all_gather(h_BD, "dp", axis=0, tiled=True)  # rows to the weights
    part_RV = lm_head_product(h_RD, w_DV)
    if mode == "split":
        full_RV = jax.lax.all_gather(part_RV, ALL, axis=1, tiled=True)
        return jax.lax.dynamic_slice_in_dim(full_RV, jax.lax.axis_index("dp") * B, B, axis=0)
    # a2a: send each device only the rows of its own group, receive every vocab slice of my rows
    send = jnp.repeat(part_RV.reshape(dp, 1, B, -1), tp, axis=1).reshape(dp * tp * B, -1)
    recv = jax.lax.all_to_all(send, ALL, 0, 0, tiled=True)  # [world * B, V/world]
    return recv.reshape(dp * tp, B, -1).transpose(1, 0, 2).reshape(B, -1)


# ---- EP: dispatch and combine ------------------------------------------------------------------


def dispatch_combine_moe(h_TD, idx_TK, w_TK, moe, world: int, fixed_tree: bool = False):
    """Expert-parallel routed experts: each device holds E/world whole experts; the XLA:CPU path, and the
    reference of `ragged_dispatch_combine_moe` in the tests.

    idx_TK holds physical slot ids (`MoE.physical_choices`; the logical ids when there are no redundant experts),
    the sentinel one past the last slot for padding rows.
    Dispatch sends every (row, choice) pair to the device holding its expert through an all-to-all
    with a fixed capacity of T*K slots per destination (exact, nothing dropped), so each device sends
    `world` times the rows that travel. Padding rows carry the sentinel expert and are never sent.
    Returns (y_TD float32, rows received per local expert).
    fixed_tree (--enable-deterministic-inference): each expert output is its down projection's partial products
    over the fixed contraction blocks added by the fixed tree on the expert's device, and a row's outputs come back
    to be weighted and added in choice order (`combine_choices`): the bits of the tensor-parallel MoE's.
    """
    T, K = idx_TK.shape
    E_local = moe.num_local_experts
    C = T * K
    dest_P = idx_TK.reshape(-1) // E_local  # the sentinel E gives dest == world: not sent
    sent_P = dest_P < world
    onehot_PW = (dest_P[:, None] == jnp.arange(world)[None, :]).astype(jnp.int32)
    slot_P = jnp.take_along_axis(jnp.cumsum(onehot_PW, axis=0), jnp.minimum(dest_P, world - 1)[:, None],
                                 axis=1)[:, 0] - 1
    flat_P = jnp.where(sent_P, dest_P * C + slot_P, world * C)
    tok_P = jnp.arange(T * K) // K
    send_x = jnp.zeros((world * C, h_TD.shape[1]), h_TD.dtype).at[flat_P].set(h_TD[tok_P], mode="drop")
    local_e_P = idx_TK.reshape(-1) - dest_P * E_local
    send_e = jnp.full((world * C,), E_local, jnp.int32).at[flat_P].set(local_e_P, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, ALL, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, ALL, 0, 0, tiled=True)
    if fixed_tree:
        parts, rows_E = moe.expert_blocks(recv_x, recv_e[:, None], split_blocks(moe_width(moe), 1))
        y = block_sum(parts)[:, 0]
    else:
        y, rows_E = moe.experts(recv_x, recv_e[:, None], jnp.ones((world * C, 1), jnp.float32))
    back = jax.lax.all_to_all(y, ALL, 0, 0, tiled=True)
    back = jnp.concatenate([back, jnp.zeros((1, back.shape[1]), back.dtype)])
    if fixed_tree:
        return combine_choices(back[jnp.minimum(flat_P, world * C)].reshape(T, K, -1), w_TK), rows_E
    y_P = back[jnp.minimum(flat_P, world * C)] * jnp.where(sent_P, w_TK.reshape(-1), 0.0)[:, None]
    return jax.ops.segment_sum(y_P, tok_P, num_segments=T), rows_E


def ragged_dispatch_combine_moe(h_TD, idx_TK, w_TK, moe, world: int, exchange=jax.lax.ragged_all_to_all):
    """`dispatch_combine_moe` moving only the rows that travel (XLA:GPU; `lax.ragged_all_to_all` does not
    run on XLA:CPU, where the tests pass an `exchange` with its semantics).

    The T*K (row, choice) pairs are sorted by destination device and each device sends its contiguous
    chunks; a tiny all-gather of the [world, world] send counts gives every device where its chunk lands
    in each receiver's buffer. The receive buffer keeps room for the worst case (every pair of every
    device to this device's experts: world*T*K rows, exact, nothing dropped); unused rows hold the
    sentinel expert, which the grouped matmul skips. Combine is the same exchange backwards.
    """
    T, K = idx_TK.shape
    E_local, N, D = moe.num_local_experts, T * K, h_TD.shape[1]
    e_P = idx_TK.reshape(-1)
    dest_P = e_P // E_local  # the sentinel E gives dest == world: sorts last, never sent
    order = jnp.argsort(dest_P, stable=True)
    tok_sorted = order // K
    send_W = jnp.bincount(dest_P, length=world + 1)[:world].astype(jnp.int32)
    counts_WW = jax.lax.all_gather(send_W, ALL)  # [source, destination]
    me = jax.lax.axis_index(ALL)
    recv_W = counts_WW[:, me]
    send_off_W = jnp.cumsum(send_W) - send_W
    recv_off_W = jnp.cumsum(recv_W) - recv_W
    land_W = (jnp.cumsum(counts_WW, axis=0) - counts_WW)[me]  # where my chunk starts in each receiver
    back_land_W = (jnp.cumsum(counts_WW, axis=1) - counts_WW)[:, me]  # where each source sent from
    recv_x = exchange(h_TD[tok_sorted], jnp.zeros((world * N, D), h_TD.dtype), send_off_W, send_W, land_W,
                      recv_W, axis_name=ALL)
    recv_e = exchange((e_P - dest_P * E_local)[order].astype(jnp.int32), jnp.full((world * N,), E_local, jnp.int32),
                      send_off_W, send_W, land_W, recv_W, axis_name=ALL)
    y, rows_E = moe.experts(recv_x, recv_e[:, None], jnp.ones((world * N, 1), jnp.float32))
    back = exchange(y, jnp.zeros((N, D), y.dtype), recv_off_W, recv_W, back_land_W, send_W, axis_name=ALL)
    w_sorted = jnp.where(dest_P < world, w_TK.reshape(-1), 0.0)[order]
    return jax.ops.segment_sum(back * w_sorted[:, None], tok_sorted, num_segments=T), rows_E


def ragged_a2a_on(platform: str) -> bool:
    """Whether EP dispatch uses `ragged_all_to_all` on this platform (XLA:GPU has it, XLA:CPU does not)."""
    return platform in ("gpu", "cuda", "rocm")


# ---- the comm object the model calls -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshComm:
    """The model's view of the mesh for one compiled step (see `jaxdp.model.decoder.Comm`)."""

    gather: GatherSpec
    moe_mode: str  # "tp" | "ep"
    dense_replicated: bool
    lm_mode: str
    num_rows: int  # T: this rank's row bucket
    rows_R: jax.Array  # rows of every rank (for SUM_LEN offsets)
    tied_head: bool = False
    ep_ragged: bool = False  # EP dispatch through ragged_all_to_all (GPU) instead of fixed capacity
    count_experts: bool = False  # `moe` also returns this device's rows' routed tokens per logical expert
    fixed_tree: bool = False  # --enable-deterministic-inference: split products summed by the fixed tree

    @property
    def world(self) -> int:
        return self.gather.dp * self.gather.tp

    @property
    def chunk(self) -> int:
        """Rows each device carries through the FFN: the rank's T rows split over its tp devices."""
        return -(-self.num_rows // self.gather.tp)

    def _my_chunk(self, a):
        n, tp = self.chunk, self.gather.tp
        a = jnp.pad(a, [(0, n * tp - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
        return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index("tp") * n, n)

    def attn_to_ffn(self, a_TD, x_TD, norm_w, eps):
        """Residual add and FFN norm; with tp > 1 the group's all-reduce becomes a reduce-scatter. a_TD may be
        o_proj's partial products over this device's blocks of heads [b, T, D] (batch-invariant kernels,
        `MLA.output`): then added by the fixed tree (`sum_head_blocks`), whatever tp."""
        if a_TD.ndim == 3:
            a_TD = block_sum(a_TD) if self.gather.tp == 1 else sum_head_blocks(a_TD, self.chunk, self.gather.tp)
            x_TD = x_TD if self.gather.tp == 1 else self._my_chunk(x_TD)
            x_TD = x_TD + a_TD.astype(x_TD.dtype)
            return x_TD, rms_norm(x_TD, norm_w, eps)
        if self.gather.tp == 1:
            x_TD = x_TD + a_TD.astype(x_TD.dtype)
            return x_TD, rms_norm(x_TD, norm_w, eps)
        n, tp = self.chunk, self.gather.tp
        a_TD = jnp.pad(a_TD, ((0, n * tp - a_TD.shape[0]), (0, 0)))
        x_nD = self._my_chunk(x_TD) + jax.lax.psum_scatter(a_TD, "tp", scatter_dimension=0, tiled=True)
        return x_nD, rms_norm(x_nD, norm_w, eps)

    def ffn_to_attn(self, y_nD, x_nD):
        x_nD = x_nD + y_nD.astype(x_nD.dtype)
        if self.gather.tp == 1:
            return x_nD
        return jax.lax.all_gather(x_nD, "tp", axis=0, tiled=True)[: self.num_rows]

    def moe(self, h_nD, valid_T, moe):
        """The MoE on this device's rows: (y [n, D], rows received per held expert); with `count_experts` the second
        is (those rows, this device's own rows' routed tokens per logical expert [E]: the expert-distribution
        recorder's, `jaxdp.eplb.recorder`; a sum over the devices counts every rank's rows once)."""
        valid_n = self._my_chunk(valid_T) if self.gather.tp > 1 else valid_T
        fixed = self.fixed_tree and moe.quantization is None
        if self.moe_mode == "ep":  # no gather, no return: rows travel inside dispatch and combine
            idx_nK, w_nK = moe.route(h_nD, valid_n)
            counts_E = count_choices(idx_nK, moe.cfg.n_routed_experts) if self.count_experts else None
            # logical experts -> physical slots (redundant experts: the map is an input, jaxdp.eplb)
            first_row = jax.lax.axis_index(ALL) * h_nD.shape[0]
            counts_WE = None
            if moe.dispatches_dynamically:  # (--ep-dispatch-algorithm dynamic: every device's pairs per expert)
                counts_WE = jax.lax.all_gather(count_choices(idx_nK, moe.cfg.n_routed_experts), ALL)
            idx_nK = moe.physical_choices(idx_nK, moe.num_local_experts * self.world, first_row, counts_WE,
                                          jax.lax.axis_index(ALL))
            if fixed:  # (the shared expert is whole here: its blocks all on this device)
                y_nD, rows_E = dispatch_combine_moe(h_nD, idx_nK, w_nK, moe, self.world, fixed_tree=True)
                shared = moe.shared_expert(h_nD, split_blocks(moe_width(moe, shared=True), 1))
                return y_nD + block_sum(shared), self._rows(rows_E, counts_E)
            dispatch = ragged_dispatch_combine_moe if self.ep_ragged else dispatch_combine_moe
            y_nD, rows_E = dispatch(h_nD, idx_nK, w_nK, moe, self.world)
            return y_nD + moe.shared_expert(h_nD).astype(jnp.float32), self._rows(rows_E, counts_E)
        h_RD, valid_R = gather_for_moe(h_nD, valid_n, self.rows_R, self.gather)
        idx_RK, w_RK = moe.route(h_RD, valid_R)
        counts_E = None
        n = h_nD.shape[0]
        if self.count_experts:  # (every device routed every rank's rows: count only this device's chunk)
            E = moe.cfg.n_routed_experts
            padded = jnp.concatenate([idx_RK, jnp.full((n, idx_RK.shape[1]), E, idx_RK.dtype)])
            own_nK = jax.lax.dynamic_slice_in_dim(padded, _chunk_start(self.rows_R, n, self.gather), n)
            counts_E = count_choices(jnp.where(valid_n[:, None], own_nK, E), E)
        if fixed:  # each expert's and the shared expert's partials over the fixed blocks, to the rows' devices
            parts, rows_E = moe.expert_blocks(h_RD, idx_RK, split_blocks(moe_width(moe), self.world))
            b, R, K, D = parts.shape
            t_nKD = block_sum(return_blocks(parts.reshape(b, R, K * D), self.rows_R, n, self.gather)).reshape(n, K, D)
            shared = moe.shared_expert(h_RD, split_blocks(moe_width(moe, shared=True), self.world))
            w_nK = jax.lax.dynamic_slice_in_dim(jnp.concatenate([w_RK, jnp.zeros((n, K), w_RK.dtype)]),
                                                _chunk_start(self.rows_R, n, self.gather), n)
            y_nD = combine_choices(t_nKD, w_nK) + block_sum(return_blocks(shared, self.rows_R, n, self.gather))
            return y_nD, self._rows(rows_E, counts_E)
        y_RD, rows_E = moe.experts(h_RD, idx_RK, w_RK)
        y_RD = y_RD + moe.shared_expert(h_RD).astype(jnp.float32)
        return return_from_moe(y_RD, self.rows_R, self.chunk, self.gather), self._rows(rows_E, counts_E)

    def _rows(self, rows_E, counts_E):
        return (rows_E, counts_E) if self.count_experts else rows_E

    def dense_ffn(self, h_nD, valid_T, mlp):
        if self.dense_replicated:
            return block_sum(mlp(h_nD, split_blocks(mlp_width(mlp), 1))) if self.fixed_tree else mlp(h_nD)
        valid_n = self._my_chunk(valid_T) if self.gather.tp > 1 else valid_T
        h_RD, _ = gather_for_moe(h_nD, valid_n, self.rows_R, self.gather)
        if self.fixed_tree:
            parts = mlp(h_RD, split_blocks(mlp_width(mlp), self.world))
            return block_sum(return_blocks(parts, self.rows_R, self.chunk, self.gather))
        return return_from_moe(mlp(h_RD).astype(jnp.float32), self.rows_R, self.chunk, self.gather)

    def lm_head(self, h_BD, w_DV):
        if self.lm_mode != "replicated" and self.tied_head:
            # tied embeddings: the head is the (replicated) embedding; take this device's vocab slice
            n = w_DV.shape[1] // self.world
            me = jax.lax.axis_index("dp") * self.gather.tp + jax.lax.axis_index("tp")
            w_DV = jax.lax.dynamic_slice_in_dim(w_DV, me * n, n, axis=1)
        return lm_head_logits(h_BD, w_DV, self.lm_mode, self.gather.dp, self.gather.tp)


def moe_width(moe, shared: bool = False) -> int:
    """The intermediate columns of one routed expert (or of the shared expert) held on this device."""
    if shared:
        return 0 if moe.shared is None else mlp_width(moe.shared)
    return weight(moe, "w_down_EID").shape[1]


def mlp_width(mlp) -> int:
    """The intermediate columns of an MLP held on this device."""
    return weight(mlp, "w_down_FD").shape[0]
