"""The embedded default model: its tokenizer, its data, and its held-out accuracy through the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import (
    ARITHMETIC,
    LONG,
    LONG_MAX,
    LONG_MIN,
    SKILLS,
    PackShape,
    example_ids,
    held_out_problems,
    is_held_out,
    pack_group,
    parse_mix,
    train_batches,
    training_example,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(default_model_path())


def test_shipped_files_are_small():
    d = default_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (d / name).is_file(), name
    assert sum(f.stat().st_size for f in d.iterdir()) < 10 * 2**20


def test_tokenizer_round_trip(tok):
    for text in ("37+48=85", "sort 3142=1234", "reverse cat=tac", "héllo, wörld! ∑ 日本", ""):
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "37+48="}])
    assert text == "<bos><|user|>37+48=<|assistant|>"
    ids = tok.encode(text)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=False) == text
    turns = [{"role": "user", "content": "6*7="}, {"role": "assistant", "content": "42"}]
    full = tok.apply_chat_template(turns, add_generation_prompt=False)
    assert full.endswith("<|assistant|>42<eos>")
    assert tok.eos_token_id == tok.encode("<eos>", add_special_tokens=False)[0]


def test_missing_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer(tmp_path)


def test_data_is_deterministic(tok):
    assert [training_example(3, i) for i in range(50)] == [training_example(3, i) for i in range(50)]
    assert [training_example(3, i) for i in range(50)] != [training_example(4, i) for i in range(50)]
    a, b = train_batches(tok, 7, 2), train_batches(tok, 7, 2)
    for _ in range(3):
        x, y = next(a), next(b)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    assert held_out_problems(20) == held_out_problems(20)


def test_held_out_never_trained_on():
    held = held_out_problems(100)
    assert {p.skill for p in held} == set(SKILLS)
    assert all(is_held_out(p.skill, p.prompt) for p in held)
    train = {(p.skill, p.prompt) for p, _ in (training_example(0, i) for i in range(5000))}
    assert not train & {(p.skill, p.prompt) for p in held}
    assert not any(is_held_out(s, q) for s, q in train)


def test_answers_are_correct():
    for p in held_out_problems(30):
        expr = p.prompt[:-1]
        if p.skill in (*ARITHMETIC, "mul3"):
            a, op, b = next(expr.partition(o) for o in "+-*" if o in expr)
            assert int(p.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        elif p.skill in ("sort", "long_sort"):
            assert p.answer == "".join(sorted(expr.split()[1])) and expr.startswith("sort ")
        elif p.skill in ("reverse", "long_reverse"):
            assert p.answer == expr.split()[1][::-1] and expr.startswith("reverse ")
        else:
            _, c, word = expr.split()
            assert p.answer == str(word.count(c))
        if p.skill in LONG:
            assert LONG_MIN <= len(p.answer) <= LONG_MAX and p.answer.isalpha() and p.answer.islower()


def test_pack_group_targets(tok):
    p, _ = training_example(0, 0)
    ids, weights = example_ids(tok, p, chat=True)
    g = pack_group([(ids, weights), (ids, weights)], PackShape(rows=320, max_seqs=4), tok.pad_token_id)
    n = len(ids)
    assert list(g["seq"][: 2 * n]) == [0] * n + [1] * n and (g["seq"][2 * n:] == 4).all()
    assert list(g["positions"][n: 2 * n]) == list(range(n))
    assert list(g["labels"][: n - 1]) == ids[1:]
    answer = tok.encode(p.answer, add_special_tokens=False) + [tok.eos_token_id]
    assert [int(t) for t, m in zip(g["labels"][:n], g["loss_mask"][:n], strict=True) if m] == answer
    assert g["loss_mask"].sum() == 2 * len(answer) and list(g["seq_lens"]) == [n, n, 0, 0]


def test_mix_is_parsed_and_refused_in_one_sentence():
    mix = parse_mix("add=2,sub=2,mul=4,mul3=0,count=1,sort=0.5,reverse=0.5,long_reverse=0,long_sort=0")
    assert list(mix) == list(SKILLS) and abs(sum(mix.values()) - 1) < 1e-12 and mix["mul"] == 0.4
    full = "add=1,sub=1,mul=1,mul3=1,count=1,sort=1,reverse=1,long_reverse=1,long_sort=1"
    for bad in ("add=1", full.replace("reverse=1", "reverse=x"), full.replace("reverse=", "rev="),
                full.replace("1", "0"), "add=1," + full, full.replace("sort=1", "sort=-1"),
                full.replace(",long_sort=1", "")):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)
    problems = [training_example(0, i, {**{s: 0.0 for s in SKILLS}, "mul": 1.0})[0] for i in range(20)]
    assert {p.skill for p in problems} == {"mul"}


def test_training_forward_is_the_serving_forward(tok):
    """Training runs the decoder without a cache (each sequence attends to its own rows) and with the
    routed experts as one dense product; the logits are those of the serving path (a flat extend step
    over a paged cache, experts sorted and run with ragged_dot)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxdp.config import PRESETS
    from jaxdp.model.decoder import DeepseekV3, empty_kv_cache
    from jaxdp.model.mla import AttnBatch
    from jaxdp.parallel.local import LocalComm
    from jaxdp.training.train import DEFAULT_OVERRIDES, flat_logits, parse_overrides

    cfg = parse_overrides(DEFAULT_OVERRIDES, PRESETS["tiny"])
    model = DeepseekV3(cfg, nnx.Rngs(3))
    shape = PackShape(rows=192, max_seqs=12)
    g = {k: jnp.asarray(v[0]) for k, v in next(train_batches(tok, 0, 1, shape)).items()}
    got = np.asarray(flat_logits(model, g))
    S = shape.max_len
    batch = AttnBatch(g["positions"], g["seq"], g["seq"] * S + g["positions"],
                      jnp.arange(shape.max_seqs)[:, None], g["seq_lens"])
    want, _, _ = model(g["tokens"], g["seq"] < shape.max_seqs, batch, empty_kv_cache(cfg, shape.max_seqs, S),
                       jnp.arange(shape.rows), LocalComm(), absorbed=False)
    valid = np.asarray(g["seq"] < shape.max_seqs)
    assert valid.sum() > 48
    np.testing.assert_allclose(got[valid], np.asarray(want)[valid], atol=2e-5, rtol=1e-5)


def test_train_cli_end_to_end(tmp_path, capsys):
    """A few steps of `python -m jaxdp.training.train` on a small shape: the loss log, an orbax checkpoint, the
    summary, and an export the serving loader reads back with the trained weights."""
    import jax
    from flax import nnx

    from jaxdp.model.loader import load_model
    from jaxdp.training.train import main

    out = tmp_path / "run"
    argv = ["--steps", "4", "--groups", "2", "--eval-n", "2", "--ckpt-every", "2", "--out", str(out),
            "--config-overrides", "hidden_size=64", "intermediate_size=96", "q_lora_rank=32", "kv_lora_rank=32"]
    assert main(argv) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [4] and np.isfinite(log[0]["loss"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["args"][:2] == ["--steps", "4"] and set(summary["held_out_accuracy"]) >= set(SKILLS)
    assert (out / "checkpoints" / "4").is_dir()
    cfg, model = load_model(out / "hf", "float32")
    assert cfg.hidden_size == 64 and Tokenizer(out / "hf").vocab_size == Tokenizer(default_model_path()).vocab_size
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))
    assert "exported to" in capsys.readouterr().out
    assert main(["--out", str(tmp_path / "bad"), "--mix", "add=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --mix") and err.count("\n") == 1
    long_only = {s: 0.5 if s in LONG else 0.0 for s in SKILLS}
    with pytest.raises(ValueError, match="cannot hold an example"):
        next(train_batches(Tokenizer(default_model_path()), 0, 1, PackShape(rows=48, max_seqs=4), long_only))


def test_default_model_held_out_arithmetic():
    """Greedy, through the compiled mesh step on one device, on held-out arithmetic: the issue's goal is
    95% (the shipped model measures 99.3% with 100 problems per skill, see
    jaxdp/assets/default-model/README.md)."""
    from jaxdp.training.eval import evaluate_local

    acc = evaluate_local("default", "dp=1", n=40, skills=ARITHMETIC)
    assert acc["arithmetic"] >= 0.95, acc
    assert min(acc["add"], acc["sub"], acc["mul"]) >= 0.9, acc


LAYOUTS = ["dp=8", "tp=8", "dp=2,tp=4", "dp=8,moe=ep"]


def test_default_model_answers_the_same_under_every_layout():
    """The held-out answers on one device and under dp=8, tp=8, dp=2,tp=4 and dp=8 with EP are identical."""
    from jaxdp.training.data import held_out_problems
    from jaxdp.training.eval import answers_local

    problems = held_out_problems(4, ARITHMETIC + ("sort",))
    one = answers_local("default", problems, "dp=1")
    assert sum(a == p.answer for a, p in zip(one, problems, strict=True)) >= len(problems) // 2
    for spec in LAYOUTS:
        assert answers_local("default", problems, spec) == one, spec


def test_default_model_drafts_long_answers():
    """The shipped MTP layer drafting 3 steps for the shipped model (greedy speculative decoding simulated,
    `jaxdp.training.eval.evaluate_speculative`) on held-out long answers: the issue's goal is an accept length of
    2.5 (the card records the figures with 100 problems per skill)."""
    from jaxdp.training.eval import evaluate_speculative

    assert json.loads((default_model_path() / "config.json").read_text())["num_nextn_predict_layers"] == 1
    accept, _ = evaluate_speculative("default", n=6, k=3, skills=LONG)
    assert accept["long"] >= 2.5, accept


@pytest.mark.slow
def test_retrain_reproduces_accuracy(tmp_path):
    """Retraining with the recorded commands and seeds (`training.json`: the earlier stages, each starting from the
    one before, then the last) gives the shipped accuracy within 1 point, all stages in under 35 minutes."""
    import time

    from jaxdp.training.eval import evaluate_local

    record = json.loads((default_model_path() / "training.json").read_text())
    commands = [stage["args"] for stage in record.get("stages", [])] + [record["args"]]
    env = {**os.environ, "XLA_FLAGS": ""}
    t0 = time.perf_counter()
    for i, argv in enumerate(commands):
        argv = [str(tmp_path / a) if a.startswith("STAGE") else a for a in argv]  # STAGE1/hf: stage 1's export
        subprocess.run([sys.executable, "-m", "jaxdp.training.train", *argv, "--eval-n", "2",
                        "--out", str(tmp_path / f"STAGE{i + 1}")], check=True, env=env)
    assert time.perf_counter() - t0 < 35 * 60
    n = 100
    shipped = evaluate_local("default", "dp=1", n=n, skills=ARITHMETIC)["arithmetic"]
    again = evaluate_local(tmp_path / f"STAGE{len(commands)}" / "hf", "dp=1", n=n, skills=ARITHMETIC)["arithmetic"]
    assert abs(shipped - again) <= 0.01, (shipped, again)
