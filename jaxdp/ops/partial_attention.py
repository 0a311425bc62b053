"""Absorbed MLA attention over a part of each row's context, with the log-sum-exp of its scores, and the exact
merge of such parts (decode context parallelism, `--dcp-size`: each device of a DCP subgroup attends over its own
tokens; `jaxdp.parallel.dcp` merges the parts across the subgroup with collectives, `merge_partials` is the
single-device reference of that merge).

A part's output is softmax-weighted over its own entries only; with lse = log(sum(exp(scores))) of each part, the
whole context's output is sum_i o_i * exp(lse_i - logsumexp_i(lse_i)), exactly (up to rounding). A part with no
valid entry has lse about NEG_INF and weighs nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdp.ops.attention import NEG_INF, decode_widths, gather_context


def attend_latents_partial(q_BHK, kv_BXK, valid_BX, softmax_scale, kv_lora_rank):
    """Absorbed attention of each row's query (latent then rope, K wide) over its valid entries kv_BXK: the output
    [B, H, L] (float32) and the log-sum-exp of the scaled scores [B, H] (float32)."""
    s_BHX = jnp.einsum("bhk,bxk->bhx", q_BHK, kv_BXK.astype(q_BHK.dtype), preferred_element_type=jnp.float32)
    s_BHX = jnp.where(valid_BX[:, None, :], s_BHX * softmax_scale, NEG_INF)
    m_BH = jnp.max(s_BHX, axis=-1)
    p_BHX = jnp.exp(s_BHX - m_BH[..., None])
    l_BH = jnp.sum(p_BHX, axis=-1)
    o_BHK = jnp.einsum("bhx,bxk->bhk", p_BHX, kv_BXK.astype(jnp.float32))
    return o_BHK[..., :kv_lora_rank] / l_BH[..., None], m_BH + jnp.log(l_BH)


def mla_decode_partial(q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, lens_B, *, softmax_scale, kv_lora_rank):
    """Each row's query over the first lens_B[b] entries its page table names (in table order): (o [B, H, L],
    lse [B, H]), both float32. As `mla_decode_xla`, it gathers only the leading pages the longest row fills,
    rounded up to a width of `decode_widths` (one branch of a switch each), not the whole page table."""
    q_BHK = jnp.concatenate([q_latent_BHL, q_rope_BHR.astype(q_latent_BHL.dtype)], -1)
    N, S = page_table_BN.shape[1], kv_PSK.shape[1]

    def attend(n):
        def run(q_BHK, kv_PSK, page_table_BN, lens_B):
            kv_BCK = gather_context(kv_PSK, page_table_BN[:, :n])
            valid_BC = jnp.arange(n * S)[None, :] < lens_B[:, None]
            return attend_latents_partial(q_BHK, kv_BCK, valid_BC, softmax_scale, kv_lora_rank)
        return run

    widths, args = decode_widths(N, S), (q_BHK, kv_PSK, page_table_BN, lens_B)
    if len(widths) == 1:
        return attend(N)(*args)
    branch = jnp.sum(jnp.asarray(widths[:-1], jnp.int32) < (jnp.max(lens_B) + S - 1) // S)
    return jax.lax.switch(branch, [attend(n) for n in widths], *args)


def merge_partials(o_NBHL: jax.Array, lse_NBH: jax.Array) -> jax.Array:
    """The whole context's output from N parts' outputs and log-sum-exps (stacked on the leading axis)."""
    total_BH = jax.nn.logsumexp(lse_NBH, axis=0)
    return jnp.sum(o_NBHL * jnp.exp(lse_NBH - total_BH)[..., None], axis=0)
