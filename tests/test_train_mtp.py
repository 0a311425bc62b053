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
    g = {k: jnp.asarray(v) for k, v in pack_group(seqs, PackShape(rows=64, max_seqs=4), tok.pad_token_id).items()}
    labels, mask = mtp_targets(g)
    (a, wa), (b, wb) = seqs
    n = len(a)
    assert list(np.asarray(labels[: n - 2])) == a[2:]  # row r: the token at r + 2
    assert list(np.asarray(mask[: n - 2])) == wa[2:]  # weighted as the main loss weights that token
    assert float(mask[n - 2]) == 0 and float(mask[n - 1]) == 0  # nothing two ahead in the sequence
    assert list(np.asarray(labels[n: n + len(b) - 2])) == b[2:]
    assert float(mask.sum()) == sum(wa[2:]) + sum(wb[2:])


def test_the_model_starts_from_the_same_weights_with_or_without_mtp():
    cfg = parse_overrides(SMALL, PRESETS["tiny"])
    plain = Trainer(cfg, 5, PackShape(), optax.sgd(0.1))
    with_mtp = Trainer(cfg, 5, PackShape(), optax.sgd(0.1), mtp_weight=0.3)
    same = jax.tree.map(lambda x, y: bool((x == y).all()), plain.params, with_mtp.params["model"])
    assert all(jax.tree.leaves(same))


def test_an_mtp_layer_trains_and_exports_for_the_loader(tmp_path):
    out = tmp_path / "run"
    argv = ["--steps", "3", "--groups", "2", "--eval-n", "2", "--ckpt-every", "3", "--out", str(out),
            "--mtp-weight", "0.3", "--config-overrides", *SMALL]
    assert main(argv) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert np.isfinite(log[-1]["loss"])
    args = json.loads((out / "summary.json").read_text())["args"]
    assert args[args.index("--mtp-weight") + 1] == "0.3"  # the replay command trains it again
    assert json.loads((out / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # the exported MTP layer, read by the serving loader: the training forward (experts as one dense product, no
    # cache) and the serving one (experts sorted) give the same logits
    cfg, model = load_model(out / "hf", "float32")
    _, mtp = load_mtp(str(out / "hf"), "float32")
    tok = Tokenizer(out / "hf")
    shape = PackShape(rows=48, max_seqs=4)
    g = {k: jnp.asarray(v[0]) for k, v in next(train_batches(tok, 0, 1, shape)).items()}
    _, mtp_logits = flat_logits(model, g, mtp)
    R = shape.rows
    batch = AttnBatch(positions_T=g["positions"], seq_T=g["seq"])
    _, _, _, hidden = model(g["tokens"], g["seq"] < 4, batch, None, jnp.arange(R), LocalComm(dense_experts=True),
                            absorbed=False, return_hidden=True)
    want, _, _, _ = mtp(g["labels"], hidden, g["seq"] < 4, batch, None, jnp.arange(R), LocalComm(),
                        model.embed_VD[...], model.lm_head_weight(), absorbed=False)
    valid = np.asarray(g["seq"] < 4)
    np.testing.assert_allclose(np.asarray(mtp_logits)[valid], np.asarray(want)[valid], atol=2e-5, rtol=1e-5)
    assert np.abs(np.asarray(want)[valid]).max() > 0
