"""Verifying drafted tokens on the device: which of a request's draft tokens the target accepts, and the
token that follows them, so that the tokens a request gets are distributed exactly as the target's.

A verify step gives, for each request, the target's distribution at K + 1 positions: after each of its K
draft tokens' predecessors and after the last draft token. Speculative sampling (Leviathan et al. 2023,
Chen et al. 2023), as vLLM's rejection sampler and SGLang's `tree_speculative_sampling_target_only` do it:

- draft token j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) while every earlier one was;
- at the first rejected position n the next token is drawn from the residual max(0, p_n - q_n),
  renormalized; when all K are accepted, from p_K (the bonus token);
- q is the draft's distribution over the vocabulary at each position, or, for a draft that picks its
  token deterministically (EAGLE/MTP with topk 1, the draft's argmax), a point mass on the draft token:
  then acceptance is p_j(d_j) and the residual is p_n without d_n.

The target distribution p is the request's own: temperature, top-k, top-p and min-p applied as in normal
sampling (`jaxdp.engine.step.sampling.filtered_probs`), so a request samples from the same distribution with
or without speculation. A greedy row (temperature 0) accepts exactly the draft tokens equal to the target's
argmax and then takes the argmax: its tokens are the greedy tokens without speculation.

Shapes: B rows (one per request), K draft tokens, V the vocabulary. Each row's key is its own, so a
request's tokens do not depend on the others in the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def verify_row(p_KV, q_KV, draft_K, greedy_K1, is_greedy, key, n_draft=None):
    """One row: p_KV the target's filtered probabilities at the K + 1 positions ([K + 1, V]), q_KV the
    draft's at the K drafted positions ([K, V]) or None for point masses, draft_K the draft tokens,
    greedy_K1 the target's argmax at the K + 1 positions, is_greedy whether the row samples greedily;
    n_draft: how many of the K are drafts (the rest are not offered: the token after the last draft is drawn
    from the target itself; 0 for a row that only samples, such as a prompt's first token). Default K.

    Returns (tokens [K + 1]: the accepted draft tokens, then the next token, then -1 padding;
    accepted: the number of draft tokens accepted, 0..K)."""
    K = draft_K.shape[0]
    p_draft = p_KV[:K][jnp.arange(K), draft_K]
    q_draft = jnp.ones_like(p_draft) if q_KV is None else q_KV[jnp.arange(K), draft_K]
    accept_key, next_key = jax.random.split(key)
    u = jax.random.uniform(accept_key, (K,), p_draft.dtype)
    sampled_ok = u * q_draft < p_draft  # u in [0, 1): accepted with probability min(1, p / q); never when p = 0
    ok = jnp.where(is_greedy, draft_K == greedy_K1[:K], sampled_ok)
    offered = jnp.arange(K) < (K if n_draft is None else n_draft)
    ok = ok & offered
    accepted = jnp.argmin(jnp.concatenate([ok, jnp.zeros((1,), bool)]))  # leading accepts (K when all)
    q_full = jax.nn.one_hot(draft_K, p_KV.shape[1], dtype=p_KV.dtype) if q_KV is None else q_KV
    residual_KV = jnp.where(offered[:, None], jnp.maximum(p_KV[:K] - q_full, 0.0), p_KV[:K])
    residual_KV = jnp.concatenate([residual_KV, p_KV[K:]])  # position K: no draft, the target itself
    dist_V = residual_KV[accepted]
    total = dist_V.sum()
    # an all-zero residual means p <= q everywhere, i.e. p = q and nothing is ever rejected there: keep p
    dist_V = jnp.where(total > 0, dist_V, p_KV[accepted])
    sampled = jax.random.categorical(next_key, jnp.log(dist_V))
    following = jnp.where(is_greedy, greedy_K1[accepted], sampled).astype(jnp.int32)
    j = jnp.arange(K + 1)
    drafts = jnp.concatenate([draft_K, jnp.zeros((1,), draft_K.dtype)]).astype(jnp.int32)
    tokens = jnp.where(j < accepted, drafts, jnp.where(j == accepted, following, -1))
    return tokens, accepted.astype(jnp.int32)


@jax.jit
def verify_tokens(p_BKV, q_BKV, draft_BK, greedy_BK, is_greedy_B, keys_B):
    """`verify_row` over a step's rows: p_BKV [B, K + 1, V], q_BKV [B, K, V] or None, draft_BK [B, K],
    greedy_BK [B, K + 1], is_greedy_B [B], keys_B [B] (typed keys). Returns tokens [B, K + 1] (-1 past each
    row's last token) and accepted [B]."""
    return jax.vmap(verify_row)(p_BKV, q_BKV, draft_BK, greedy_BK, is_greedy_B, keys_B)
