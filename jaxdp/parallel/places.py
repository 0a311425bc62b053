"""The four places where "each rank has its own rows" meets "all ranks compute this together".

1. `gather_for_moe`   — before the MoE (and gathered dense layers): MAX_LEN all-gather of padded
                        rows, or the SUM_LEN exact buffer (each rank writes at its offset, then a sum);
2. `return_from_moe`  — after it: reduce-scatter (MAX_LEN), or sum and copy out (SUM_LEN);
3. `agree_on_step`    — before each step, on the host: rows per rank, the decode-bucket vote (AND),
                        "any rank reads a prompt" (OR), who runs an idle batch;
4. `lm_head_logits`   — the LM head: rows to a vocab-split head (gather, then all-gather of logits),
                        the all-to-all form, or the whole head on every rank.
Plus the EP MoE (`dispatch_combine_moe`), where rows leave their rank inside dispatch and come back
inside combine, and no gather or return happens around the MoE.

Everything but `agree_on_step` runs inside the step's shard_map over the mesh ("dp", "tp").
Shape suffixes: T rows of this rank, R gathered rows, B sequences, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

ALL = ("dp", "tp")


@dataclasses.dataclass(frozen=True)
class GatherSpec:
    mode: str  # "max_len" | "sum_len"
    dp: int
    tp: int
    sum_rows: int = 0  # SUM_LEN buffer rows (static); >= the sum of all ranks' rows


# ---- 1. the gather -----------------------------------------------------------------------------


def gather_for_moe(h_TD, valid_T, rows_R, g: GatherSpec):
    """Every rank's rows on every device: returns (h_RD, valid_R)."""
    if g.mode == "max_len":
        h_RD = jax.lax.all_gather(h_TD, "dp", axis=0, tiled=True)
        return h_RD, jax.lax.all_gather(valid_T, "dp", axis=0, tiled=True)
    T, D = h_TD.shape
    offset = _rank_offset(rows_R)
    buf = jnp.zeros((g.sum_rows + T, D), h_TD.dtype)
    buf = jax.lax.dynamic_update_slice(buf, jnp.where(valid_T[:, None], h_TD, 0), (offset, 0))
    h_RD = jax.lax.psum(buf[: g.sum_rows], "dp")
    return h_RD, jnp.arange(g.sum_rows) < rows_R.sum()


# ---- 2. the return -----------------------------------------------------------------------------


def return_from_moe(y_RD, rows_R, num_rows: int, g: GatherSpec):
    """The sum of every device's partial results, for this rank's rows only: [T, D]."""
    if g.mode == "max_len":
        y_TD = jax.lax.psum_scatter(y_RD, "dp", scatter_dimension=0, tiled=True)
    else:
        y = jax.lax.psum(y_RD, "dp")
        y = jnp.concatenate([y, jnp.zeros((num_rows, y.shape[1]), y.dtype)])
        y_TD = jax.lax.dynamic_slice_in_dim(y, _rank_offset(rows_R), num_rows, axis=0)
    return jax.lax.psum(y_TD, "tp") if g.tp > 1 else y_TD


def _rank_offset(rows_R):
    r = jax.lax.axis_index("dp")
    return jnp.cumsum(rows_R)[r] - rows_R[r]


# ---- 3. the agreement --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What one rank's scheduler would run next."""

    rows: int  # token rows of its batch (0: nothing to do)
    is_extend: bool  # it reads a prompt (chunk)
    decode_bucket_ok: bool  # its decode batch fits a compiled decode bucket


@dataclasses.dataclass(frozen=True)
class Agreement:
    rows_per_rank: tuple[int, ...]
    any_extend: bool  # OR over ranks
    use_decode_bucket: bool  # AND over ranks
    idle_ranks: tuple[int, ...]  # ranks that run an idle batch
    run: bool  # False when every rank is idle: no step at all


def agree_on_step(proposals: list[Proposal]) -> Agreement:
    """Every rank computes this from the same numbers and so reaches the same decision."""
    rows = tuple(p.rows for p in proposals)
    run = any(r > 0 for r in rows)
    any_extend = any(p.is_extend for p in proposals)
    busy = [p for p in proposals if p.rows > 0]
    use_decode = run and not any_extend and all(p.decode_bucket_ok for p in busy)
    idle = tuple(i for i, r in enumerate(rows) if r == 0) if run else ()
    return Agreement(rows, any_extend, use_decode, idle, run)


# ---- 4. the LM head ----------------------------------------------------------------------------


def lm_head_logits(h_BD, w_DV, mode: str, dp: int, tp: int):
    """Full-vocab float32 logits of this rank's rows [B, V]."""
    if mode == "replicated":
        return jnp.einsum("bd,dv->bv", h_BD, w_DV, preferred_element_type=jnp.float32)
    B = h_BD.shape[0]
    h_RD = jax.lax.all_gather(h_BD, "dp", axis=0, tiled=True)  # rows to the weights
    part_RV = jnp.einsum("rd,dv->rv", h_RD, w_DV, preferred_element_type=jnp.float32)
    if mode == "split":
        full_RV = jax.lax.all_gather(part_RV, ALL, axis=1, tiled=True)
        return jax.lax.dynamic_slice_in_dim(full_RV, jax.lax.axis_index("dp") * B, B, axis=0)
    # a2a: send each device only the rows of its own group, receive every vocab slice of my rows
    send = jnp.repeat(part_RV.reshape(dp, 1, B, -1), tp, axis=1).reshape(dp * tp * B, -1)
    recv = jax.lax.all_to_all(send, ALL, 0, 0, tiled=True)  # [world * B, V/world]
    return recv.reshape(dp * tp, B, -1).transpose(1, 0, 2).reshape(B, -1)


# ---- EP: dispatch and combine ------------------------------------------------------------------


def dispatch_combine_moe(h_TD, idx_TK, w_TK, moe, world: int):
    """Expert-parallel routed experts: each device holds E/world whole experts.

    Dispatch sends every (row, choice) pair to the device holding its expert through an all-to-all
    with a fixed capacity of T*K slots per destination (exact, nothing dropped; `ragged_all_to_all`
    would send only the used slots but does not run on XLA:CPU). Padding rows carry the sentinel
    expert and are never sent. Returns (y_TD float32, rows received per local expert).
    """
    T, K = idx_TK.shape
    E_local = moe.w_gate_up_ED2I.get_value().shape[0]
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
    y, rows_E = moe.experts(recv_x, recv_e[:, None], jnp.ones((world * C, 1), jnp.float32))
    back = jax.lax.all_to_all(y, ALL, 0, 0, tiled=True)
    back = jnp.concatenate([back, jnp.zeros((1, back.shape[1]), back.dtype)])
    y_P = back[jnp.minimum(flat_P, world * C)] * jnp.where(sent_P, w_TK.reshape(-1), 0.0)[:, None]
    return jax.ops.segment_sum(y_P, tok_P, num_segments=T), rows_E


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

    @property
    def world(self) -> int:
        return self.gather.dp * self.gather.tp

    def attention_out(self, y_TD):
        return jax.lax.psum(y_TD, "tp") if self.gather.tp > 1 else y_TD

    def moe(self, h_TD, valid_T, moe):
        if self.moe_mode == "ep":
            return self._ep_moe(h_TD, valid_T, moe)
        h_RD, valid_R = gather_for_moe(h_TD, valid_T, self.rows_R, self.gather)
        idx_RK, w_RK = moe.route(h_RD, valid_R)
        y_RD, rows_E = moe.experts(h_RD, idx_RK, w_RK)
        y_RD = y_RD + moe.shared_expert(h_RD).astype(jnp.float32)
        return return_from_moe(y_RD, self.rows_R, self.num_rows, self.gather), rows_E

    def _ep_moe(self, h_TD, valid_T, moe):
        tp, T = self.gather.tp, self.num_rows
        if tp > 1:  # the rows of a group are on each of its tp devices: each dispatches a 1/tp share
            n = -(-T // tp)
            h_TD = jnp.pad(h_TD, ((0, n * tp - T), (0, 0)))
            valid_T = jnp.pad(valid_T, (0, n * tp - T))
            i = jax.lax.axis_index("tp") * n
            h_TD, valid_T = (jax.lax.dynamic_slice_in_dim(a, i, n) for a in (h_TD, valid_T))
        idx_TK, w_TK = moe.route(h_TD, valid_T)
        y_TD, rows_E = dispatch_combine_moe(h_TD, idx_TK, w_TK, moe, self.world)
        y_TD = y_TD + moe.shared_expert(h_TD).astype(jnp.float32)
        if tp > 1:
            y_TD = jax.lax.all_gather(y_TD, "tp", axis=0, tiled=True)[:T]
        return y_TD, rows_E

    def dense_ffn(self, h_TD, valid_T, mlp):
        if self.dense_replicated:
            return mlp(h_TD)
        h_RD, _ = gather_for_moe(h_TD, valid_T, self.rows_R, self.gather)
        return return_from_moe(mlp(h_RD).astype(jnp.float32), self.rows_R, self.num_rows, self.gather)

    def lm_head(self, h_BD, w_DV):
        if self.lm_mode != "replicated" and self.tied_head:
            # tied embeddings: the head is the (replicated) embedding; take this device's vocab slice
            n = w_DV.shape[1] // self.world
            me = jax.lax.axis_index("dp") * self.gather.tp + jax.lax.axis_index("tp")
            w_DV = jax.lax.dynamic_slice_in_dim(w_DV, me * n, n, axis=1)
        return lm_head_logits(h_BD, w_DV, self.lm_mode, self.gather.dp, self.gather.tp)


def sum_len_rows(rows: list[int] | np.ndarray, quantum: int = 8) -> int:
    """The exact buffer's row count, rounded up to a small quantum so few shapes compile."""
    total = int(np.sum(rows))
    return max(quantum, -(-total // quantum) * quantum)
