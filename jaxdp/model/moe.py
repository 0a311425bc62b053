"""The DeepSeek-V3 MoE: sigmoid router with correction bias and group-limited top-k, routed experts
through a grouped matmul, one shared expert.

Padding rows never reach an expert: `route` gives them the sentinel expert id E (one past the last),
which sorts after every real expert and falls outside every group of the grouped matmul, so the
experts compute exactly the rows a request needs. `routed_experts` returns the rows each expert
received, which the step reports and the tests count.

Under a layout the expert weights a device holds are a slice (TP: a slice of the intermediate dim of
every expert; EP: whole experts `expert_offset .. expert_offset + E_local`); shapes come from the arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.layers import MLP, init_normal


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router_DE = nnx.Param(init_normal(rngs, (D, E), jnp.float32, D))
        self.router_bias_E = nnx.Param(jnp.zeros((E,), jnp.float32))
        self.w_gate_up_ED2I = nnx.Param(init_normal(rngs, (E, D, 2, I), dtype, D))
        self.w_down_EID = nnx.Param(init_normal(rngs, (E, I, D), dtype, I))
        self.shared = MLP(D, I * cfg.n_shared_experts, rngs, dtype) if cfg.n_shared_experts else None

    def route(self, x_TD: jax.Array, valid_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        return route(x_TD, valid_T, self.router_DE[...], self.router_bias_E[...], self.cfg)

    def experts(self, x_TD, idx_TK, w_TK, expert_offset=0):
        return routed_experts(x_TD, idx_TK, w_TK, self.w_gate_up_ED2I[...], self.w_down_EID[...],
                              expert_offset)

    def shared_expert(self, x_TD: jax.Array) -> jax.Array:
        return self.shared(x_TD) if self.shared is not None else jnp.zeros_like(x_TD)


def route(x_TD, valid_T, router_DE, bias_E, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Top-k expert ids [T, k] and weights [T, k]; padding rows get id E and weight 0."""
    E, G, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    scores_TE = jax.nn.sigmoid(x_TD.astype(jnp.float32) @ router_DE.astype(jnp.float32))
    choice_TE = scores_TE + bias_E[None, :]
    if G > 1:
        group_scores_TG = jax.lax.top_k(choice_TE.reshape(-1, G, E // G), 2)[0].sum(-1)
        _, top_groups = jax.lax.top_k(group_scores_TG, cfg.topk_group)
        group_mask_TG = jnp.zeros_like(group_scores_TG, bool).at[
            jnp.arange(x_TD.shape[0])[:, None], top_groups].set(True)
        expert_mask_TE = jnp.repeat(group_mask_TG, E // G, axis=1)
        choice_TE = jnp.where(expert_mask_TE, choice_TE, -jnp.inf)
    _, idx_TK = jax.lax.top_k(choice_TE, k)
    w_TK = jnp.take_along_axis(scores_TE, idx_TK, axis=1)
    if cfg.norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(-1, keepdims=True) + 1e-20)
    w_TK = w_TK * cfg.routed_scaling_factor
    idx_TK = jnp.where(valid_T[:, None], idx_TK, E)
    w_TK = jnp.where(valid_T[:, None], w_TK, 0.0)
    return idx_TK.astype(jnp.int32), w_TK


def routed_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset=0):
    """Sum over a row's chosen experts (among those held here) of weight * expert(row).

    Returns (y_TD in float32, rows received per local expert [E_local]). Pairs whose expert is not
    held here (another device's, or the padding sentinel) sort last and are not computed.
    """
    T, K = idx_TK.shape
    E_local, D, _, I = w_gate_up_ED2I.shape
    local_e = idx_TK.reshape(-1) - expert_offset
    held = (local_e >= 0) & (local_e < E_local)
    local_e = jnp.where(held, local_e, E_local)
    order = jnp.argsort(local_e, stable=True)
    tok_sorted = order // K
    group_sizes_E = jnp.bincount(local_e, length=E_local + 1)[:E_local].astype(jnp.int32)
    x_sorted = x_TD[tok_sorted]
    h = jax.lax.ragged_dot(x_sorted, w_gate_up_ED2I.reshape(E_local, D, 2 * I), group_sizes_E,
                           preferred_element_type=jnp.float32).reshape(-1, 2, I)
    h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
    y = jax.lax.ragged_dot(h, w_down_EID, group_sizes_E, preferred_element_type=jnp.float32)
    y = y * jnp.where(held, w_TK.reshape(-1), 0.0)[order][:, None]
    y_TD = jax.ops.segment_sum(y, tok_sorted, num_segments=T)
    return y_TD, group_sizes_E
