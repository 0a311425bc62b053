"""A prompt step's one-row sequences (a mixed chunk's decoders; under DP, other ranks' decoders relabeled as
one-token extends) are attended all at once in the absorbed form, as a decode step attends them, and the
loops over sequences skip them: the same output as attending every row densely."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.config import get_config
from jaxdp.model import mla as mla_module
from jaxdp.model import mla_prompt as prefill
from jaxdp.model.mla import MLA, AttnBatch

S, PAGES = 4, 12
# (first new position, new rows): a prompt after a cached prefix, a fresh prompt, decoders riding along (their
# whole context cached, one at position 0: a one-token prompt), then two sequence slots the step pads to
PIECES = [(20, 23), (0, 9), (37, 1), (5, 1), (0, 1), (44, 1)]
PAD_ROWS, PAD_SEQS = 3, 2


def step(rng, cfg, pieces=PIECES):
    B = len(pieces) + PAD_SEQS
    P = B * PAGES + 1
    kv = jnp.asarray(rng.normal(size=(P, S, cfg.kv_cache_dim)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, P)).reshape(B, PAGES), jnp.int32)
    seq = np.concatenate([np.full(n, b) for b, (_, n) in enumerate(pieces)] + [np.full(PAD_ROWS, B)])
    pos = np.concatenate([np.arange(p0, p0 + n) for p0, n in pieces] + [np.zeros(PAD_ROWS, int)])
    lens = np.zeros(B, np.int32)
    lens[: len(pieces)] = [p0 + n for p0, n in pieces]
    T = len(seq)
    rows = np.asarray(table)[np.minimum(seq, B - 1), pos // S]
    kv_TK = jnp.asarray(np.asarray(kv)[rows, pos % S])  # what the step wrote (padding rows: anything)
    batch = AttnBatch(jnp.asarray(pos, jnp.int32), jnp.asarray(seq, jnp.int32), None, table, jnp.asarray(lens))
    H, N, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q_nope = jnp.asarray(rng.normal(size=(T, H, N)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(T, H, R)), jnp.float32)
    return q_nope, q_rope, kv, kv_TK, batch, int((seq < B).sum())


def spy(monkeypatch, module, name, record, arg):
    """Wrap module.name so that each time it runs (not when traced: a branch not taken records nothing), its
    argument `arg(args, kwargs)` lands in `record`."""
    real = getattr(module, name)

    def wrapped(*a, **k):
        jax.debug.callback(lambda x: record.append(np.asarray(x)), arg(a, k))
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapped)


def run(form, pieces, seed, monkeypatch):
    """(the step's output, dense attention's, real rows, lengths the absorbed decode read, see_T of each run of
    the loops over sequences)."""
    cfg = get_config("tiny")
    attn = MLA(cfg, nnx.Rngs(0))
    q_nope, q_rope, kv, kv_TK, batch, n = step(np.random.default_rng(seed), cfg, pieces)
    kw = dict(kv_lora_rank=cfg.kv_lora_rank, softmax_scale=cfg.softmax_scale)
    want = prefill.attend_dense(q_nope, q_rope, kv, batch.page_table_BN, batch.seq_T, batch.positions_T,
                                attn.w_kv_b_LHX[...], **kw)[:n]
    monkeypatch.setattr(prefill, "prompt_form", lambda *a, **k: form)
    decoded, looped = [], []
    spy(monkeypatch, mla_module, "mla_decode_default", decoded, lambda a, k: a[4])
    spy(monkeypatch, prefill, "blocked_state", looped, lambda a, k: a[5] if k.get("see_T") is None else k["see_T"])
    got = jax.jit(lambda *a: attn.attend_expanded(*a[:4], kv_TK=a[4]))(q_nope, q_rope, kv, batch, kv_TK)
    jax.effects_barrier()
    return np.asarray(got), np.asarray(want), n, decoded, looped


ONE_ROWS = np.repeat([k == 1 for _, k in PIECES], [k for _, k in PIECES])


@pytest.mark.parametrize("form,block", [("split", 16), ("blocked", 16), ("split", 3)])
def test_one_row_sequences_attended_absorbed_match_dense(form, block, monkeypatch):
    monkeypatch.setattr(mla_module, "ONE_ROW_BLOCK", block)  # 3: two blocks for the four, the last one short
    got, want, n, decoded, looped = run(form, PIECES, 3, monkeypatch)
    np.testing.assert_allclose(got[:n], want, rtol=2e-5, atol=2e-5)
    assert np.isfinite(got).all()
    assert len(decoded) == -(-4 // min(block, len(PIECES) + PAD_SEQS))  # a pass per block of them
    lens = np.concatenate(decoded)  # the one-row sequences, and only they, read absorbed, each once
    assert sorted(lens[lens > 0]) == sorted(p0 + 1 for p0, k in PIECES if k == 1)
    assert looped  # (the prompt after a cached prefix reads its context in the loops)
    for see_T in looped:  # which skip the one-row sequences (see_T -1: no cached position read)
        assert (see_T[: len(ONE_ROWS)][ONE_ROWS] == -1).all()


def test_fresh_prompts_and_decoders_run_no_loop_over_sequences(monkeypatch):
    """Fresh prompts and decoders (the usual mixed step, and every DP step in which one rank reads a new prompt):
    the split form's cached part has nothing left to read, so it does not run (it ran a loop per decoder)."""
    fresh = [(0, PIECES[0][1]), *PIECES[1:]]  # sequence 0's prompt starts at position 0 too
    got, want, n, decoded, looped = run("split", fresh, 4, monkeypatch)
    np.testing.assert_allclose(got[:n], want, rtol=2e-5, atol=2e-5)
    assert len(decoded) == 1 and looped == []
