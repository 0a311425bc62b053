"""Sampling on the device (jaxdp.engine.step.sampling): the filters against a numpy reference, and the batch's
branches (no sort, a partial sort, a full one) drawing the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.engine.step.sampling import PARTIAL_TOP_K, _keep, _sample_row, sample_tokens

V = 600  # over PARTIAL_TOP_K, so the partial branch sorts only part of the vocabulary


def reference_keep(scaled, top_p, top_k, min_p):
    """The filters written out: the top_k best, the smallest best-first prefix reaching top_p, min_p."""
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(len(scaled), bool)
    k = top_k if 0 < top_k < len(scaled) else len(scaled)
    before = 0.0
    for rank, i in enumerate(order):
        if rank < k and (top_p >= 1 or before < top_p):  # (top_p 1: no filter, whatever the rounding)
            keep[i] = True
        before += probs[i]
    return keep & (probs >= min_p * probs.max())


ROWS = [(1.0, 1.0, -1, 0.0), (0.7, 1.0, -1, 0.2), (1.3, 0.9, -1, 0.0), (1.0, 1.0, 5, 0.0), (2.0, 0.5, 40, 0.05),
        (1.0, 1.0, PARTIAL_TOP_K, 0.0), (1.0, 1.0, PARTIAL_TOP_K + 1, 0.0), (0.0, 0.3, 3, 0.0)]


def test_the_filters_match_a_reference_in_every_branch_that_may_run_them():
    logits = np.asarray(jax.random.normal(jax.random.key(0), (len(ROWS), V)) * 3)
    for row, (t, p, k, m) in zip(logits, ROWS, strict=True):
        scaled = row / max(t, 1e-6)
        want = reference_keep(scaled, p, k, m)
        args = (jnp.asarray(scaled), jnp.float32(p), jnp.int32(k), jnp.float32(m))
        modes = ["sorted"] + (["partial"] if 0 < k <= PARTIAL_TOP_K or (p >= 1 and not 0 < k < V) else []) + (
            ["plain"] if p >= 1 and not 0 < k < V else [])
        for mode in modes:
            np.testing.assert_array_equal(np.asarray(_keep(*args, mode)), want, err_msg=f"{mode} {(t, p, k, m)}")


def test_a_rows_token_does_not_depend_on_the_branch_its_batch_takes():
    """A seeded row draws the same token whether its batch sorts nothing, part or all of the vocabulary."""
    logits = jax.random.normal(jax.random.key(1), (V,)) * 0.5
    keys = jax.random.randint(jax.random.key(2), (20, 2), 0, 2**31 - 1).astype(jnp.uint32)
    for t, p, k, m in [(1.0, 1.0, -1, 0.0), (0.8, 1.0, -1, 0.1)]:
        draws = {mode: [int(_sample_row(logits, t, p, k, m, key, mode)[0]) for key in keys]
                 for mode in ("plain", "partial", "sorted")}
        assert draws["plain"] == draws["partial"] == draws["sorted"]
        assert len(set(draws["plain"])) > 3  # the draws are random at all


def test_sample_tokens_takes_each_branch_and_keeps_rows_within_their_filters():
    logits = jax.random.normal(jax.random.key(3), (1, 4, V)) * 3
    keys = jnp.arange(8, dtype=jnp.uint32).reshape(1, 4, 2)
    top = np.argsort(-np.asarray(logits[0]), axis=-1)
    cases = {  # (temperature, top_p, top_k, min_p) per row
        "greedy": [(0.0, 1.0, -1, 0.0)] * 4,
        "plain": [(1.0, 1.0, -1, 0.0), (0.0, 1.0, -1, 0.0), (1.0, 1.0, -1, 0.5), (2.0, 1.0, V, 0.0)],
        "partial": [(1.0, 1.0, 3, 0.0), (1.0, 1.0, -1, 0.0), (1.0, 0.5, 10, 0.0), (0.0, 0.1, -1, 0.0)],
        "sorted": [(1.0, 0.3, -1, 0.0), (1.0, 1.0, 3, 0.0), (1.0, 1.0, PARTIAL_TOP_K + 1, 0.0), (0.0, 1.0, 2, 0.0)],
    }
    for name, rows in cases.items():
        t, p, k, m = (jnp.asarray([[r[i] for r in rows]], dtype) for i, dtype in
                      enumerate((jnp.float32, jnp.float32, jnp.int32, jnp.float32)))
        tokens, logprobs = sample_tokens(logits, t, p, k, m, keys, width=6)
        assert tokens.shape == (1, 6) and bool(jnp.all(jnp.isfinite(logprobs)))
        lp = jax.nn.log_softmax(logits[0], axis=-1)
        for b, (tb, _, kb, _) in enumerate(rows):
            tok = int(tokens[0, b])
            assert abs(float(logprobs[0, b]) - float(lp[b, tok])) <= 1e-6  # (jaxdp.ops.rows: a tree sum)
            if tb == 0:
                assert tok == top[b, 0], name
            elif 0 < kb < V:
                assert tok in top[b, :kb], name
