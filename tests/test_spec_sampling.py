"""Speculative sampling (`jaxdp.engine.step.spec_sampling`): greedy rows keep exactly the target's greedy tokens,
and sampled rows' tokens follow the target's distribution (chi-square over 20,000 draws)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxdp.engine.step.spec_sampling import verify_tokens

N = 20_000


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (cells with probability 0 must be
    empty: a draw there fails the test outright)."""
    n = counts.sum()
    live = probs > 0
    if counts[~live].sum():
        return 0.0
    expected = n * probs[live]
    stat = float((((counts[live] - expected) ** 2) / expected).sum())
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _probs(rng, shape, zero_some=True):
    logits = rng.normal(size=shape) * 1.5
    if zero_some:  # a target filtered by top-k / top-p has tokens of probability 0
        logits[..., 0] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def _draws(p_KV, q_KV, draft_K, n=N, seed=0):
    K = draft_K.shape[-1]
    p = jnp.broadcast_to(jnp.asarray(p_KV), (n, *p_KV.shape))
    q = None if q_KV is None else jnp.broadcast_to(jnp.asarray(q_KV), (n, *q_KV.shape))
    draft = jnp.asarray(draft_K if draft_K.ndim == 2 else np.broadcast_to(draft_K, (n, K)))
    greedy = jnp.broadcast_to(jnp.argmax(jnp.asarray(p_KV), -1), (n, K + 1))
    keys = jax.random.split(jax.random.key(seed), n)
    tokens, accepted = verify_tokens(p, q, draft, greedy, jnp.zeros((n,), bool), keys)
    return np.asarray(tokens), np.asarray(accepted)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "draft-argmax"])
def test_sampled_tokens_follow_the_target_distribution(point_mass):
    rng = np.random.default_rng(1)
    V, K = 8, 2
    p = _probs(rng, (K + 1, V))
    if point_mass:  # a deterministic draft (its argmax): a token the target likes, the same in every row
        q, draft = None, np.array([np.argmax(p[0]), np.argsort(p[1])[-2]])
    else:  # a draft model near the target (half its distribution, half noise), its tokens drawn from it per row
        q = (0.5 * p[:K] + 0.5 * _probs(rng, (K, V), zero_some=False)).astype(np.float32)
        draft = np.stack([rng.choice(V, size=N, p=q[j] / q[j].sum()) for j in range(K)], axis=1)
    tokens, accepted = _draws(p, q, draft)
    d0 = draft[..., 0]
    # the first token of every row follows p_0
    first = np.bincount(tokens[:, 0], minlength=V)
    assert _chi_square_p(first, p[0]) > 1e-3, (first / N, p[0])
    # given that the first draft was accepted, the second token follows p_1 (the target after d_0)
    kept = accepted >= 1
    assert (tokens[kept, 0] == np.broadcast_to(d0, (N,))[kept]).all()
    second = np.bincount(tokens[kept, 1], minlength=V)
    assert kept.sum() > 1000
    assert _chi_square_p(second, p[1]) > 1e-3, (second / kept.sum(), p[1])
    # acceptance of the first draft: sum over d of q(d) min(1, p(d)/q(d)) = sum min(p, q), or p(d) for a point mass
    expected = p[0, d0] if q is None else np.minimum(p[0], q[0]).sum()
    assert abs((accepted >= 1).mean() - expected) < 0.02
    # rows end with -1 after their last token
    for row, a in zip(tokens[:50], accepted[:50], strict=True):
        assert (row[a + 1:] == -1).all() and (row[: a + 1] >= 0).all()


def test_the_test_can_fail():
    """A sampler that ignored rejection (always kept the draft) is refused by the same statistic."""
    rng = np.random.default_rng(2)
    p = _probs(rng, (1, 8))[0]
    wrong = np.bincount(np.full(N, 3), minlength=8)
    assert _chi_square_p(wrong, p) < 1e-6


def test_greedy_rows_keep_the_greedy_tokens():
    rng = np.random.default_rng(3)
    B, K, V = 64, 3, 16
    p = jnp.asarray(_probs(rng, (B, K + 1, V), zero_some=False))
    greedy = jnp.argmax(p, -1)
    draft = np.asarray(greedy[:, :K]).copy()
    wrong_at = rng.integers(0, K + 1, size=B)  # K: every draft right
    for b, w in enumerate(wrong_at):
        if w < K:
            draft[b, w] = (draft[b, w] + 1) % V
    keys = jax.random.split(jax.random.key(0), B)
    tokens, accepted = verify_tokens(p, None, jnp.asarray(draft), greedy, jnp.ones((B,), bool), keys)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    np.testing.assert_array_equal(accepted, wrong_at)
    for b in range(B):
        a = wrong_at[b]
        np.testing.assert_array_equal(tokens[b, : a + 1], np.asarray(greedy[b, : a + 1]))
        assert (tokens[b, a + 1:] == -1).all()


@pytest.mark.parametrize("n_draft", [0, 1])
def test_fewer_drafts_offered_than_positions(n_draft):
    """A row offering n_draft < K drafts (a prompt's first token: 0) accepts at most n_draft, and the token after
    the offered ones follows the target there (no draft subtracted from it)."""
    from jaxdp.engine.step.spec_sampling import verify_row

    rng = np.random.default_rng(4)
    V, K = 8, 2
    p = _probs(rng, (K + 1, V))
    draft = np.array([np.argmax(p[0]), np.argmax(p[1])])
    keys = jax.random.split(jax.random.key(5), N)
    f = jax.jit(jax.vmap(verify_row, in_axes=(None, None, None, None, None, 0, None)))
    tokens, accepted = f(jnp.asarray(p), None, jnp.asarray(draft), jnp.argmax(jnp.asarray(p), -1), False, keys,
                         n_draft)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert accepted.max() == n_draft
    after = tokens[accepted == n_draft, n_draft]
    assert _chi_square_p(np.bincount(after, minlength=V), p[n_draft]) > 1e-3


def test_filtered_probs_are_what_a_row_samples_from():
    """`filtered_probs` (what speculative sampling accepts against) is the distribution `sample_tokens` draws
    from: temperature, top-k, top-p and min-p applied the same way (chi-square over the sampler's draws)."""
    from jaxdp.engine.step.sampling import filtered_probs, sample_tokens

    rng = np.random.default_rng(6)
    V = 16
    logits = jnp.asarray(rng.normal(size=(V,)) * 2, jnp.float32)
    t, top_p, top_k, min_p = 0.7, 0.9, 6, 0.02
    p = np.asarray(filtered_probs(logits, t, top_p, top_k, min_p), np.float64)
    n = 4000
    ones = np.ones((1, n), np.float32)
    keys = np.stack([np.full(n, 11, np.uint32), np.arange(n, dtype=np.uint32)], -1)[None]
    tokens, _ = sample_tokens(jnp.broadcast_to(logits, (1, n, V)), jnp.asarray(ones * t), jnp.asarray(ones * top_p),
                              jnp.asarray(np.full((1, n), top_k, np.int32)), jnp.asarray(ones * min_p),
                              jnp.asarray(keys))
    assert (p > 0).sum() <= top_k
    assert _chi_square_p(np.bincount(np.asarray(tokens)[0], minlength=V), p / p.sum()) > 1e-3
