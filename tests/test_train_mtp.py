"""The trainer's MTP layer (issue 28: the default model learns to draft): its targets, its initial weights
beside the model's, and an export whose MTP layer the serving loader reads back with the trained numbers."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdp.config import PRESETS
from jaxdp.model.loader import default_model_path, load_model, load_mtp
from jaxdp.model.mla import AttnBatch
from jaxdp.parallel.local import LocalComm
from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import PackShape, example_ids, pack_group, train_batches, training_example
from jaxdp.training.train import Trainer, flat_logits, main, mtp_targets, parse_overrides

SMALL = ["hidden_size=64", "intermediate_size=96", "q_lora_rank=32", "kv_lora_rank=32"]


def test_mtp_targets_are_two_ahead_in_the_same_sequence():
    tok = Tokenizer(default_model_path())
    seqs = [example_ids(tok, *training_example(0, i)) for i in range(2)]
    g = {k: jnp.asarray(v) for k, v in pack_group(seqs, PackShape(rows=320, max_seqs=4), tok.pad_token_id).items()}
    labels, masks = mtp_targets(g)
    assert masks.shape == (1, 320)
    mask = masks[0]
    (a, wa), (b, wb) = seqs
    n = len(a)
    assert list(np.asarray(labels[: n - 2])) == a[2:]  # row r: the token at r + 2
    assert list(np.asarray(mask[: n - 2])) == wa[2:]  # weighted as the main loss weights that token
    assert float(mask[n - 2]) == 0 and float(mask[n - 1]) == 0  # nothing two ahead in the sequence
    assert list(np.asarray(labels[n: n + len(b) - 2])) == b[2:]
    assert float(mask.sum()) == sum(wa[2:]) + sum(wb[2:])
    # the unrolled chain: pass s counts at row r only if its chain began at row r - s + 1 of the same sequence
    _, chain = mtp_targets(g, steps=3)
    assert np.array_equal(np.asarray(chain[0]), np.asarray(mask))
    for s in (1, 2):
        want = np.asarray(mask).copy()
        want[:s] = 0
        want[n: n + s] = 0
        assert np.array_equal(np.asarray(chain[s]), want), s


def test_the_unrolled_chain_feeds_each_pass_the_previous_pass_normed_output():
    """flat_logits with 3 MTP passes: pass 1 is the single-step MTP; pass 2 at row r reads pass 1's output of
    row r - 1 after shared_norm (SGLang's draft chain), computed here pass by pass."""
    cfg = parse_overrides(SMALL, PRESETS["tiny"])
    tr = Trainer(cfg, 2, PackShape(), optax.sgd(0.1), mtp_weight=0.3, mtp_steps=3)
    model, mtp = tr.model(tr.params), tr.mtp(tr.params)
    tok = Tokenizer(default_model_path())
    seqs = [example_ids(tok, *training_example(0, i)) for i in range(3)]
    R = 480
    g = {k: jnp.asarray(v) for k, v in pack_group(seqs, PackShape(rows=R, max_seqs=4), tok.pad_token_id).items()}
    logits, chain = flat_logits(model, g, mtp, 3)
    assert chain.shape == (3, R, cfg.vocab_size)
    comm = LocalComm(dense_experts=True)
    batch, valid, rows = AttnBatch(positions_T=g["positions"], seq_T=g["seq"]), g["seq"] < 4, jnp.arange(R)
    _, _, _, hidden = model(g["tokens"], valid, batch, None, rows, comm, absorbed=False, return_hidden=True)
    h = hidden
    for s in range(3):
        want, x, _, _ = mtp(g["labels"], h, valid, batch, None, rows, comm, model.embed_VD[...], model.lm_head_weight(),
                            absorbed=False)
        np.testing.assert_allclose(np.asarray(chain[s]), np.asarray(want), atol=1e-5, rtol=1e-5)
        h = np.asarray(hidden).copy()
        h[1:] = np.asarray(mtp.shared_norm(x))[:-1]
        h = jnp.asarray(h)
    assert not np.allclose(np.asarray(chain[1]), np.asarray(chain[0]), atol=1e-3)
    assert R == logits.shape[0]


def test_the_model_starts_from_the_same_weights_with_or_without_mtp():
    cfg = parse_overrides(SMALL, PRESETS["tiny"])
    plain = Trainer(cfg, 5, PackShape(), optax.sgd(0.1))
    with_mtp = Trainer(cfg, 5, PackShape(), optax.sgd(0.1), mtp_weight=0.3)
    same = jax.tree.map(lambda x, y: bool((x == y).all()), plain.params, with_mtp.params["model"])
    assert all(jax.tree.leaves(same))


def test_an_mtp_layer_trains_and_exports_for_the_loader(tmp_path):
    out = tmp_path / "run"
    argv = ["--steps", "3", "--groups", "2", "--eval-n", "2", "--ckpt-every", "3", "--out", str(out),
            "--mtp-weight", "0.3", "--mtp-steps", "2", "--config-overrides", *SMALL]
    assert main(argv) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert np.isfinite(log[-1]["loss"])
    args = json.loads((out / "summary.json").read_text())["args"]
    assert args[args.index("--mtp-weight") + 1] == "0.3"  # the replay command trains it again
    assert args[args.index("--mtp-steps") + 1] == "2"
    assert json.loads((out / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # the exported MTP layer, read by the serving loader: the training forward (experts as one dense product, no
    # cache) and the serving one (experts sorted) give the same logits
    cfg, model = load_model(out / "hf", "float32")
    _, mtp = load_mtp(str(out / "hf"), "float32")
    tok = Tokenizer(out / "hf")
    shape = PackShape(rows=192, max_seqs=12)
    g = {k: jnp.asarray(v[0]) for k, v in next(train_batches(tok, 0, 1, shape)).items()}
    _, mtp_logits = flat_logits(model, g, mtp)
    mtp_logits = mtp_logits[0]
    R = shape.rows
    batch = AttnBatch(positions_T=g["positions"], seq_T=g["seq"])
    _, _, _, hidden = model(g["tokens"], g["seq"] < 12, batch, None, jnp.arange(R), LocalComm(dense_experts=True),
                            absorbed=False, return_hidden=True)
    want, _, _, _ = mtp(g["labels"], hidden, g["seq"] < 12, batch, None, jnp.arange(R), LocalComm(),
                        model.embed_VD[...], model.lm_head_weight(), absorbed=False)
    valid = np.asarray(g["seq"] < 12)
    np.testing.assert_allclose(np.asarray(mtp_logits)[valid], np.asarray(want)[valid], atol=2e-5, rtol=1e-5)
    assert np.abs(np.asarray(want)[valid]).max() > 0


def _tiny_model_and_mtp(seed: int):
    from flax import nnx

    from jaxdp.model.decoder import DeepseekV3
    from jaxdp.model.mtp import MTPLayer

    cfg = parse_overrides(SMALL, PRESETS["tiny"])
    return DeepseekV3(cfg, nnx.Rngs(seed)), MTPLayer(cfg, nnx.Rngs(seed + 1))


def test_speculate_counts_what_the_target_accepts():
    """Simulated speculative decoding (`jaxdp.training.eval.speculate`): a drafter that is the target itself gets
    every draft accepted (k + 1 tokens a verify, the last verify cut at max_new), a drafter that is always wrong
    gets 1, a random MTP layer about 1; the outputs are the target's greedy tokens whatever the drafter."""
    from jaxdp.training.eval import make_drafter, mtp_chain, speculate, target_chain

    model, mtp = _tiny_model_and_mtp(4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 9, 12)]
    k, max_new, eos = 3, 14, 2
    ideal, ideal_acc = speculate(model, make_drafter(target_chain, model, k=k), prompts, max_new, k, eos)
    wrong, wrong_acc = speculate(model, lambda t, n: np.full((len(n), k), -1), prompts, max_new, k, eos)
    drafted, mtp_acc = speculate(model, make_drafter(mtp_chain, model, mtp, k=k), prompts, max_new, k, eos)
    assert ideal == wrong == drafted
    for out, acc in zip(ideal, ideal_acc, strict=True):
        assert sum(acc) == len(out) - 1  # the first token comes from the prompt
        if eos not in out:
            assert len(out) == max_new and acc[:-1] == [k + 1] * (len(acc) - 1)
    assert all(acc == [1] * len(acc) for acc in wrong_acc)
    assert np.mean([a for acc in mtp_acc for a in acc]) < 1.5


def test_mtp_chain_is_the_engine_draft_chain():
    """mtp_chain (batched, padded) against the draft chain computed row by row here: step 1 at row n - 2 reads the
    target's final normed hidden state of row n - 2 and token n - 1; step s reads the previous step's output
    after shared_norm and the token it drafted, one row further, over the rows before it."""
    from jaxdp.training.eval import make_drafter, mtp_chain

    model, mtp = _tiny_model_and_mtp(6)
    k, W = 3, 32
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 200, n).tolist() for n in (6, 11)]
    tokens = np.zeros((2, W), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    got = make_drafter(mtp_chain, model, mtp, k=k)(tokens, np.array([len(p) for p in prompts], np.int32))
    comm = LocalComm()
    for p, drafts in zip(prompts, got, strict=True):
        n = len(p)
        rows = jnp.arange(n)
        batch = AttnBatch(positions_T=rows, seq_T=jnp.zeros(n, jnp.int32))
        _, _, _, hidden = model(jnp.asarray(p), rows < n, batch, None, rows, comm, absorbed=False, return_hidden=True)
        hid, tok, want = list(np.asarray(hidden)[: n - 1]), list(p[1:]), []
        for _ in range(k):
            m = len(tok)
            rows = jnp.arange(m)
            batch = AttnBatch(positions_T=rows, seq_T=jnp.zeros(m, jnp.int32))
            logits, x, _, _ = mtp(jnp.asarray(tok), jnp.asarray(np.stack(hid)), rows < m, batch, None,
                                  jnp.asarray([m - 1]), comm, model.embed_VD[...], model.lm_head_weight(),
                                  absorbed=False)
            d = int(np.argmax(np.asarray(logits[0])))
            want.append(d)
            tok.append(d)
            hid.append(np.asarray(mtp.shared_norm(x[m - 1])))
        assert list(drafts) == want
