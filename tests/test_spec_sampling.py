"""Speculative sampling (`jaxdp.engine.spec_sampling`): greedy rows keep exactly the target's greedy tokens,
and sampled rows' tokens follow the target's distribution (chi-square over 20,000 draws)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxdp.engine.spec_sampling import verify_tokens

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
