"""The four places on a single device: no rows travel, every call is local.

It is the reference every layout is compared with, and what the model runs under when it is used
without a mesh (the oracle test, training).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxdp.model.layers import rms_norm


class LocalComm:
    """dense_experts: compute the routed experts densely (`MoE.experts_dense`; training under vmap)."""

    def __init__(self, dense_experts: bool = False):
        self.dense_experts = dense_experts

    def attn_to_ffn(self, a_TD, x_TD, norm_w, eps):
        x_TD = x_TD + a_TD.astype(x_TD.dtype)
        return x_TD, rms_norm(x_TD, norm_w, eps)

    def ffn_to_attn(self, y_TD, x_TD):
        return x_TD + y_TD.astype(x_TD.dtype)

    def moe(self, h_TD, valid_T, moe):
        idx_TK, w_TK = moe.route(h_TD, valid_T)
        experts = moe.experts_dense if self.dense_experts else moe.experts
        y_TD, rows_E = experts(h_TD, idx_TK, w_TK)
        return y_TD + moe.shared_expert(h_TD).astype(jnp.float32), rows_E

    def dense_ffn(self, h_TD, valid_T, mlp):
        return mlp(h_TD)

    def lm_head(self, h_BD, w_DV):
        return jnp.einsum("bd,dv->bv", h_BD, w_DV, preferred_element_type=jnp.float32)
