"""`plan --compile --dcp-size N`: the engine's decode step over a split pool, compiled by XLA:CPU on abstract weights
of a mid-size model under tp=8: its argument bytes (weights + the device's part of the pool) within 3% of the plan,
the same pool bytes per device as without DCP for 8 times the tokens per group (and, after the step's temp, more
than 4 times the tokens). Slow: two plans, each compiling the decode step twice."""

import json

import pytest
from test_plan_compile import MID, SMALL_STEPS

from jaxdp.planner.capacity import main


def plan_of(tmp_path, model, *extra):
    out = tmp_path / "p.json"
    argv = ["--model", model, "--gpus", "8", "--gpu", "H200", "--gpu-memory", "2GiB", "--mesh", "dp=1,tp=8",
            "--expert-dtype", "fp8", "--compile", "--compile-target", "cpu", "--compile-steps", "decode",
            *SMALL_STEPS, *extra, "--json", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_compiled_split_pool_agrees_with_the_plan(tmp_path):
    (tmp_path / "mid").mkdir()
    (tmp_path / "mid" / "config.json").write_text(json.dumps(MID))
    model = str(tmp_path / "mid")
    whole, split = plan_of(tmp_path, model), plan_of(tmp_path, model, "--dcp-size", "8")
    w, s = whole["compiled"][0], split["compiled"][0]
    for c in (w, s):
        planned = c["planned_weight_bytes_per_device"] + c["planned_kv_bytes_per_device"]
        assert abs(c["argument_bytes_per_device"] / planned - 1) < 0.03, c
    assert abs(s["planned_kv_bytes_per_device"] / w["planned_kv_bytes_per_device"] - 1) < 0.01
    assert split["plan"]["kv_tokens_per_rank"] == 8 * whole["plan"]["kv_tokens_per_rank"]
    assert split["compile"]["fit"]["kv_tokens_with_temp_per_rank"] > 4 * whole["compile"]["fit"][
        "kv_tokens_with_temp_per_rank"]
