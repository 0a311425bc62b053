"""The blocked prompt path (jaxdp.model.mla_prompt) against dense attention written out in full."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.model.mla_prompt import attend_blocked, attend_dense, attend_selected, attend_split

L, R, N, V, H, S = 16, 8, 12, 10, 3, 4
SCALE = 0.3


def dense(q_nope, q_rope, kv_PSK, table, seq, pos, w, sel=None):
    return attend_dense(q_nope, q_rope, kv_PSK, table, seq, pos, w, kv_lora_rank=L, softmax_scale=SCALE, sel_TK=sel)


def step(rng, pieces, pages_per_seq, pad_rows=3):
    """A step of `pieces` (sequence, first new position, new rows); each sequence has its own pages."""
    B = len(pieces)
    P = B * pages_per_seq + 1
    kv = jnp.asarray(rng.normal(size=(P, S, L + R)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, P)).reshape(B, pages_per_seq), jnp.int32)
    seq = np.concatenate([np.full(n, b) for b, _, n in pieces] + [np.full(pad_rows, B)])
    pos = np.concatenate([np.arange(p0, p0 + n) for _, p0, n in pieces] + [np.zeros(pad_rows, int)])
    T = len(seq)
    q_nope = jnp.asarray(rng.normal(size=(T, H, N)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(T, H, R)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(L, H, N + V)) / 4, jnp.float32)
    return q_nope, q_rope, kv, table, jnp.asarray(seq, jnp.int32), jnp.asarray(pos, jnp.int32), w


# a long prompt after a cached prefix, a fresh prompt, decoders riding along as one-row sequences
PIECES = [(0, 20, 23), (1, 0, 9), (2, 37, 1), (3, 5, 1), (4, 0, 1)]


# small blocks: several windows and key blocks per sequence, ragged edges; sequences of under about a dozen
# rows take the absorbed branch there (the 23-row one does not); at the default blocks every one does
@pytest.mark.parametrize("row_block,key_block,absorbed_block", [(4, 4, 2), (5, 8, 3), (7, 12, 16), (256, 512, 16)])
def test_blocked_prompt_attention_matches_dense(row_block, key_block, absorbed_block):
    rng = np.random.default_rng(0)
    q_nope, q_rope, kv, table, seq, pos, w = step(rng, PIECES, pages_per_seq=11)
    n = int((seq < len(PIECES)).sum())
    want = dense(q_nope, q_rope, kv, table, seq, pos, w)[:n]
    fn = jax.jit(lambda *a: attend_blocked(*a, kv_lora_rank=L, softmax_scale=SCALE, row_block=row_block,
                                           key_block=key_block, absorbed_block=absorbed_block))
    got = fn(q_nope, q_rope, kv, table, seq, pos, w)
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.isfinite(np.asarray(got)).all()  # padding rows too


@pytest.mark.parametrize("row_block,key_block,absorbed_block", [(4, 4, 2), (256, 512, 16)])
def test_split_prompt_attention_matches_dense(row_block, key_block, absorbed_block):
    """The step's own rows in one piece plus the context cached before them in blocks: a prompt after a
    cached prefix, a fresh prompt, decoders (their whole context cached), padding rows and padded sequences."""
    rng = np.random.default_rng(2)
    q_nope, q_rope, kv, table, seq, pos, w = step(rng, PIECES, pages_per_seq=11)
    n = int((seq < len(PIECES)).sum())
    table = jnp.concatenate([table, jnp.zeros((3, table.shape[1]), jnp.int32)])  # sequences the step pads to
    seq = jnp.where(seq == len(PIECES), table.shape[0], seq)
    rows = np.asarray(table)[np.minimum(np.asarray(seq), len(PIECES) - 1), np.asarray(pos) // S]
    kv_TK = jnp.asarray(np.asarray(kv)[rows, np.asarray(pos) % S])  # what the step wrote (padding: anything)
    want = dense(q_nope, q_rope, kv, table, seq, pos, w)[:n]
    fn = jax.jit(lambda *a: attend_split(*a, kv_lora_rank=L, softmax_scale=SCALE, row_block=row_block,
                                         key_block=key_block, absorbed_block=absorbed_block))
    got = fn(q_nope, q_rope, kv_TK, kv, table, seq, pos, w)
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_blocked_prompt_attention_memory_does_not_scale_with_rows_times_context():
    """At DeepSeek-V3's widths (128 heads, latent 512): an 8k-row chunk against 8 sequences of a 64k page
    table. The dense form's scores alone would be 8k x 128 x 8 x 64k x 4 bytes = 2 TiB; XLA's plan for the
    blocked one stays within a few GiB (accumulators [T, H, V] plus one block)."""
    T, Hd, B, C, Sp = 8192, 128, 8, 65536, 64
    args = (jax.ShapeDtypeStruct((T, Hd, 128), jnp.bfloat16), jax.ShapeDtypeStruct((T, Hd, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((B * C // Sp, Sp, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, C // Sp), jnp.int32), jax.ShapeDtypeStruct((T,), jnp.int32),
            jax.ShapeDtypeStruct((T,), jnp.int32), jax.ShapeDtypeStruct((512, Hd, 256), jnp.bfloat16))
    fn = jax.jit(lambda *a: attend_blocked(*a, kv_lora_rank=512, softmax_scale=0.1))
    mem = fn.lower(*args).compile().memory_analysis()
    cache = B * C * 576 * 2
    assert mem.temp_size_in_bytes < 4 * 2**30, mem.temp_size_in_bytes / 2**30
    assert mem.argument_size_in_bytes >= cache


def test_selected_prompt_attention_matches_dense_with_the_selection_as_mask():
    rng = np.random.default_rng(1)
    q_nope, q_rope, kv, table, seq, pos, w = step(rng, PIECES, pages_per_seq=11)
    n, k = int((seq < len(PIECES)).sum()), 6
    # a top-k's shape: k distinct positions per row, those past the row's own position being filler
    sel = jnp.asarray(np.stack([rng.permutation(44)[:k] for _ in range(len(seq))]), jnp.int32)
    want = dense(q_nope, q_rope, kv, table, seq, pos, w, sel)[:n]
    q_latent = jnp.einsum("thn,lhn->thl", q_nope, w[..., :N])
    for block in (None, 1, 4):  # all rows at once, one row per block, blocks with a padded last one
        o = attend_selected(q_latent, q_rope, kv, table, seq, pos, sel, kv_lora_rank=L, softmax_scale=SCALE,
                            block=block)
        got = jnp.einsum("thl,lhv->thv", o, w[..., N:])[:n]
        sees = np.asarray((sel <= pos[:, None]).any(1))[:n]  # rows whose selection holds a visible position
        np.testing.assert_allclose(np.asarray(got)[sees], np.asarray(want)[sees], rtol=2e-5, atol=2e-5)


def test_prefill_benchmark_runs_both_forms_side_by_side(tmp_path):
    from jaxdp.bench.prefill import main

    out = tmp_path / "prefill.json"
    assert main(["--heads", "1", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [c["seqs"] for c in result["cases"]] == [1, 1, 17]
    for c in result["cases"]:
        assert c["dense_ms"] > 0 and c["blocked_ms"] > 0 and c["max_abs_difference"] < 0.05
        assert c["blocked_temp_bytes"] < c["dense_temp_bytes"]
    assert result["full_size"]["blocked_temp_bytes"] < 4 * 2**30 < result["full_size"]["dense_temp_bytes"]


@pytest.mark.parametrize("cached", [0, 32])
def test_prompt_step_work_does_not_grow_with_the_sequences_it_is_padded_to(cached, monkeypatch):
    """A server's extend step is padded to every request slot of its rank (up to --max-running-requests / dp)
    with the page table of the longest context: the attention of the step's own prompt rows must not cost
    in proportion to those slots. XLA's FLOP count for the default model's MLA layer, one 64-row prompt (fresh,
    or after 32 cached positions), in steps of 4 and 64 sequence slots of 256 positions each: within 1.5x.
    (The one-piece form scored every row against every slot's whole context: 16x at 64 slots, 8x slower
    serving at 16 concurrent requests with --max-running-requests 256.) Counted on XLA's products: the count does
    not see inside `jaxdp.native`'s custom calls."""
    from flax import nnx

    from jaxdp.model.loader import default_model_path
    from jaxdp.model.mla import MLA, AttnBatch
    from jaxdp.model.modelopt import load_config

    monkeypatch.setenv("JAXDP_NATIVE", "0")
    cfg = load_config(default_model_path())
    layer = MLA(cfg, nnx.Rngs(0))
    T, S, C = 64, 16, 256

    def flops(B):
        pages = B * C // S + 1
        kv = jnp.zeros((pages, S, cfg.kv_lora_rank + cfg.qk_rope_head_dim), jnp.float32)
        table = jnp.arange(1, pages, dtype=jnp.int32).reshape(B, C // S)
        pos = jnp.arange(cached, cached + T, dtype=jnp.int32)
        batch = AttnBatch(pos, jnp.zeros(T, jnp.int32), table[0, pos // S] * S + pos % S, table,
                          jnp.zeros(B, jnp.int32).at[0].set(cached + T))
        x = jnp.ones((T, cfg.hidden_size), jnp.float32)
        graph, state = nnx.split(layer)
        fn = jax.jit(lambda st, x, kv, b: nnx.merge(graph, st)(x, kv, b, absorbed=False)[0])
        return fn.lower(state, x, kv, batch).compile().cost_analysis()["flops"]

    few, many = flops(4), flops(64)
    assert many < 1.5 * few, (few, many)
