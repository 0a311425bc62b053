"""Decode context parallelism on paper (`python -m jaxdp.plan --dcp-size N`): the article's Kimi K3 row
(`--tp 32 --attn-dp-size 4 --dcp-size 8`, here at Kimi K2's sizes), its KV capacity and collectives, and the
flag's bad values refused in one sentence."""

import json

import pytest

from jaxdp.config import get_config
from jaxdp.planner.capacity import main

K3_ROW = ["--model", "kimi-k2", "--gpus", "32", "--gpu", "H200", "--tp-size", "32", "--attn-dp-size", "4",
          "--expert-dtype", "fp8"]


def plan(tmp_path, *extra):
    out = tmp_path / "plan.json"
    assert main([*K3_ROW, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_the_articles_kimi_row_holds_eight_times_the_tokens_per_group(tmp_path, capsys):
    without, split = plan(tmp_path), plan(tmp_path, "--dcp-size", "8")
    capsys.readouterr()
    per_device = without["plan"]["kv_tokens_per_rank"]  # without DCP a group holds one device's worth
    assert per_device > 0 and without["plan"]["dcp"] is None
    d = split["plan"]["dcp"]
    # the weights are the same, so each device holds as many tokens as before, and the group 8 times that
    assert d["tokens_per_device"] == per_device and d["tokens_per_group"] == 8 * per_device
    assert split["plan"]["kv_tokens_per_rank"] == 8 * per_device
    assert split["plan"]["kv_tokens_total"] == 4 * 8 * per_device
    assert split["plan"]["weights_per_device_gib"] == without["plan"]["weights_per_device_gib"]


def test_the_collectives_are_the_queries_the_lse_and_the_outputs_of_the_subgroups_heads(tmp_path, capsys):
    cfg = get_config("kimi-k2")
    d = plan(tmp_path, "--dcp-size", "8", "--rows", "16,16,16,16")["plan"]["dcp"]
    report = capsys.readouterr().out
    heads = cfg.num_heads // 8 * 8  # tp=8 gives a device 8 heads; its subgroup of 8 devices: 64
    expect = {"queries": 16 * heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2,
              "log-sum-exp": 8 * 16 * heads * 4, "partial outputs": 16 * heads * cfg.kv_lora_rank * 4}
    assert {c["name"]: c["buffer_bytes"] for c in d["collectives"]} == expect
    assert all(c["calls"] == cfg.num_layers for c in d["collectives"])
    assert d["bytes_per_step"] == sum(expect.values()) * cfg.num_layers
    assert "--dcp-size 8: each GPU holds 1/8 of every sequence" in report
    assert f"{d['tokens_per_group']:,} per group" in report


@pytest.mark.parametrize("extra, says", [
    (["--dcp-size", "3"], "must divide the attention group's tp=8"),
    (["--dcp-size", "0"], "is not a device count"),
    (["--attn-dp-size", "32", "--dcp-size", "2"], "each group is one device (tp=1)"),
    (["--dcp-size", "8", "--compile", "--speculative-algorithm", "EAGLE"], "does not speculate over a split"),
])
def test_a_dcp_size_the_layout_cannot_take_is_one_sentence(extra, says, capsys):
    assert main([*K3_ROW, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and err.count("\n") == 0 and err.startswith("plan: error:")
