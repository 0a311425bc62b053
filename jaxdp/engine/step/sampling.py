"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, a per-request seed, a min_tokens floor.

One jitted function over the step's logits [dp, B, V] (sharded over `dp`, so each rank samples its own
rows) and per-row parameters. A row below its min_tokens cannot pick its end-of-sequence and stop token ids
(its `ban` row, padded with -1): they are set to -inf before it samples; the log-probabilities stay those of
the unmodified distribution. The key of a row is (seed, number of tokens generated so far): a request
with a seed samples the same tokens whatever else runs beside it. The rows' values are the scheduler's
(`jaxdp.engine.sched.rows.sampling_row`: clamped to what the arrays and the vocabulary hold, so no value the API
lets through can fail a step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.engine.sched.request import Request
from jaxdp.ops.rows import log_softmax  # (a row's logprobs the same whatever the rows beside it)

PARTIAL_TOP_K = 256  # a batch whose filtering rows all ask for a top_k up to this sorts only its best this many


def _keep(scaled_V, top_p, top_k, min_p, mode: str):
    """The tokens a row may sample, in vocabulary order. `mode` is the batch's (the same tokens come out of
    each, so a row's draw does not depend on the rows beside it): "plain" (no row filters by rank: no sort),
    "partial" (every row that does asks for a top_k up to PARTIAL_TOP_K: `lax.top_k` of that many), "sorted"."""
    V = scaled_V.shape[0]
    keep = scaled_V >= scaled_V.max() + jnp.log(min_p)  # p >= min_p * p_max (min_p 0: every token)
    if mode == "plain":
        return keep
    k = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    if mode == "partial":
        vals, idx = jax.lax.top_k(scaled_V, min(PARTIAL_TOP_K, V))
    else:
        idx = jnp.argsort(-scaled_V)
        vals = scaled_V[idx]
    probs = jnp.exp(vals - jax.nn.logsumexp(scaled_V))  # best first, under the whole distribution
    ranked = (jnp.arange(vals.shape[0]) < k) & ((jnp.cumsum(probs) - probs) < top_p)  # (top_p: >= 1 token)
    filtered = (k < V) | (top_p < 1)
    return keep & (jnp.zeros(V, bool).at[idx].set(ranked) | ~filtered)


def filtered_probs(logits_V, temperature, top_p, top_k, min_p):
    """The distribution a row samples from (temperature, then min-p, top-k and top-p), as probabilities over
    the vocabulary: what speculative sampling accepts drafts against (`jaxdp.engine.step.spec_sampling`). A greedy
    row (temperature 0) gets its scaled distribution too; the caller takes its argmax instead."""
    scaled = logits_V.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    masked = jnp.where(_keep(scaled, top_p, top_k, min_p, "sorted"), scaled, -jnp.inf)
    return jax.nn.softmax(masked)


def _sample_row(logits_V, temperature, top_p, top_k, min_p, key_data, mode: str):
    """A row's token and its log-probability under `logits_V` (`sample_tokens` reads the token alone: the logits
    it hands here may be masked)."""
    scaled = logits_V / jnp.maximum(temperature, 1e-6)
    masked = jnp.where(_keep(scaled, top_p, top_k, min_p, mode), scaled, -jnp.inf)
    key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    token = jnp.where(temperature == 0, jnp.argmax(logits_V), jax.random.categorical(key, masked))
    return token.astype(jnp.int32), jax.nn.log_softmax(logits_V)[token]


def banned(logits_RBV, n_out_RB, min_tokens_RB, ban_RBS):
    """The logits with each row's ban ids at -inf while it has fewer than its min_tokens output tokens
    (`n_out_RB`: tokens generated before this one); the logits themselves when no row is below its floor."""
    V = logits_RBV.shape[-1]
    below = n_out_RB < min_tokens_RB

    def mask():
        ids = jnp.where(below[..., None] & (ban_RBS >= 0), ban_RBS, V)  # (V: out of range, dropped)
        row = jax.vmap(jax.vmap(lambda lv, i: lv.at[i].set(-jnp.inf, mode="drop")))
        return row(logits_RBV, ids)

    return jax.lax.cond(jnp.any(below), mask, lambda: logits_RBV)


@functools.partial(jax.jit, static_argnames="width")
def sample_tokens(logits_RBV, temperature_RB, top_p_RB, top_k_RB, min_p_RB, keys_RB2, min_tokens_RB=None,
                  ban_RBS=None, choose_RBV=None, width: int | None = None):
    """Tokens [dp, B] and their log-probabilities under the unmodified distribution; with `width`, padded
    to [dp, width] so the next step can read them on the device whatever its bucket. The vocabulary is sorted
    only when a row asks for a top_p, or for a top_k over PARTIAL_TOP_K (most of a large batch's sampling
    time: every row's vocabulary sorted). `min_tokens_RB` and `ban_RBS` (both or neither): the rows' min_tokens
    floors and the ids it holds off (`banned`). `choose_RBV`: the logits the rows choose from when they differ from
    `logits_RBV` (a logit bias, penalties or a grammar's mask: the engine samples through
    `jaxdp.engine.step.controls.sample_with_controls`, which passes its prepared logits here)."""
    if choose_RBV is None:
        choose_RBV = logits_RBV
    if min_tokens_RB is not None:
        choose_RBV = banned(choose_RBV, keys_RB2[..., 1].astype(jnp.int32), min_tokens_RB, ban_RBS)

    def greedy():  # every row greedy
        return jnp.argmax(choose_RBV, axis=-1).astype(jnp.int32)

    def sample(mode):
        f = jax.vmap(jax.vmap(functools.partial(_sample_row, mode=mode)))
        return lambda: f(choose_RBV, temperature_RB, top_p_RB, top_k_RB, min_p_RB, keys_RB2)[0]

    V = logits_RBV.shape[-1]
    top_k = (top_k_RB > 0) & (top_k_RB < V)
    ranked = (top_k | (top_p_RB < 1)) & (temperature_RB > 0)  # rows that filter by rank
    partial = jnp.all(~ranked | (top_k & (top_k_RB <= PARTIAL_TOP_K)))  # (their top_p within those)
    branch = jnp.where(jnp.all(temperature_RB == 0), 0, jnp.where(~jnp.any(ranked), 1, jnp.where(partial, 2, 3)))
    tokens = jax.lax.switch(branch, [greedy, sample("plain"), sample("partial"), sample("sorted")])
    logprobs = jnp.take_along_axis(log_softmax(logits_RBV), tokens[..., None], axis=-1)[..., 0]
    if width is not None:
        pad = ((0, 0), (0, width - tokens.shape[1]))
        tokens, logprobs = jnp.pad(tokens, pad), jnp.pad(logprobs, pad)
    return tokens, logprobs


MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's top_logprobs range)


@jax.jit
def top_logprobs(logits_RBV, ids_RBM):
    """The MAX_TOP_LOGPROBS most likely tokens of each row and their log-probabilities under the unmodified
    distribution, best first: ids and values [dp, B, MAX_TOP_LOGPROBS]; and the log-probabilities of the ids
    each row asks about (token_ids_logprob, padded) [dp, B, M] (run only for steps that ask)."""
    lp_RBV = log_softmax(logits_RBV.astype(jnp.float32))
    values, ids = jax.lax.top_k(lp_RBV, MAX_TOP_LOGPROBS)
    return ids.astype(jnp.int32), values, jnp.take_along_axis(lp_RBV, ids_RBM, axis=2)


def book_top_logprobs(reqs: list[Request], sample: np.ndarray, ids_BK: np.ndarray, values_BK: np.ndarray,
                      chosen_BM: np.ndarray) -> None:
    """Give each sampled row whose request asks for top_logprobs its k best (token, logprob) pairs, and for
    token_ids_logprob those ids' logprobs, in the same order as its output tokens (called before the scheduler
    books the step)."""
    for i, req in enumerate(reqs):
        if not sample[i] or req.finished:
            continue
        k, chosen = req.params.top_logprobs, req.params.token_ids_logprob
        if k:
            req.output_top_logprobs.append(list(zip(ids_BK[i, :k].tolist(), values_BK[i, :k].tolist(),
                                                    strict=True)))
        if chosen:
            req.output_token_ids_logprobs.append(list(zip(chosen, chosen_BM[i, : len(chosen)].tolist(), strict=True)))
