"""`plan --compile`: the engine's real steps compiled by XLA on abstract weights agree with the plan.

A mid-size model (real-ish widths scaled down: hidden 2048, 16 heads, 64 experts top-8, 4 layers) runs
the same path as the full-size cases in docs/plan.md, on the 8 host devices of tests/conftest.py (XLA:CPU;
tests/test_gpu_on_paper.py compiles for simulated GPUs).
"""

import json

import pytest
from jax.sharding import PartitionSpec as P

from jaxdp.planner.capacity import main

MID = {"model_type": "deepseek_v3", "vocab_size": 16384, "hidden_size": 2048, "intermediate_size": 4096,
       "moe_intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
       "num_key_value_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 256, "qk_nope_head_dim": 64,
       "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 64, "n_shared_experts": 1,
       "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
       "first_k_dense_replace": 1}
SMALL_STEPS = ["--decode-rows", "16", "--extend-rows", "256", "--context", "256"]


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mid")
    (d / "config.json").write_text(json.dumps(MID))
    return str(d)


def compile_plan(model, tmp_path, mesh, expert_dtype, *extra):
    out = tmp_path / "c.json"
    argv = ["--model", model, "--gpus", "8", "--gpu", "H200", "--gpu-memory", "2GiB", "--mesh", mesh,
            "--expert-dtype", expert_dtype, "--compile", "--compile-target", "cpu", *SMALL_STEPS, *extra,
            "--json", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("mesh, expert_dtype, steps", [
    ("dp=4,tp=2", "fp8", "extend"),  # CI: MAX_LEN and SUM_LEN extend; the slow case adds decode
    pytest.param("dp=8,moe=ep", "nvfp4", "decode,extend", marks=pytest.mark.slow)])
def test_xla_argument_bytes_agree_with_the_plan(mid_model, tmp_path, capsys, mesh, expert_dtype, steps):
    plan = compile_plan(mid_model, tmp_path, mesh, expert_dtype, "--compile-steps", steps)
    kinds = [(c["kind"], c["gather_mode"]) for c in plan["compiled"]]
    assert kinds == [("decode", "max_len")] * ("decode" in steps) + [("extend", "max_len"), ("extend", "sum_len")]
    for c in plan["compiled"]:
        planned = c["planned_weight_bytes_per_device"] + c["planned_kv_bytes_per_device"]
        assert abs(c["argument_bytes_per_device"] / planned - 1) < 0.03, c
        assert 0 < c["temp_bytes_without_pool_copies_per_device"] <= c["temp_bytes_per_device"] and c["compile_s"] > 0
        assert c["largest_buffers"][0]["bytes"] <= c["temp_bytes_without_pool_copies_per_device"]
        assert c["rows_per_rank"] == (16 if c["kind"] == "decode" else 256)
    assert plan["compiled"][-1]["sum_rows"] == plan["plan"]["layout"]["dp"] * 256
    # the pool is the plan's: weights + pool fill the budget, so the step's temp leaves fewer tokens
    fit = plan["compile"]["fit"]
    assert fit["kv_tokens_planned_per_rank"] == plan["plan"]["kv_tokens_per_rank"] > 0
    assert fit["kv_tokens_with_temp_per_rank"] < fit["kv_tokens_planned_per_rank"]
    assert "Compiled by XLA" in capsys.readouterr().out


def test_redundant_experts_compile_as_planned(mid_model, tmp_path):
    """--ep-num-redundant-experts 8 (64 + 8 slots, 9 a device): the compiled step holds the planned weights, the
    redundant experts and the expert map among them, to well under the redundant experts' own bytes."""
    plan = compile_plan(mid_model, tmp_path, "dp=8,moe=ep", "fp8", "--compile-steps", "decode",
                        "--ep-num-redundant-experts", "8")
    redundant = next(w for w in plan["plan"]["weights"] if w["name"] == "redundant experts")["bytes_per_device"]
    (c,) = plan["compiled"]
    planned = c["planned_weight_bytes_per_device"] + c["planned_kv_bytes_per_device"]
    assert abs(c["argument_bytes_per_device"] / planned - 1) < 0.03, c
    # a plan without the redundant experts would be `redundant` short; the compiled step is within 2% of that
    assert abs(c["argument_bytes_per_device"] - planned) < 0.02 * redundant, (c, redundant)


@pytest.mark.slow
def test_the_speculative_steps_compile_on_host_devices(tmp_path):
    """--speculative-algorithm under XLA:CPU (1-2 minutes): both speculative steps compile with the MTP layer's
    weights and its draft KV, and XLA's arguments are the plan's (which counts both)."""
    d = tmp_path / "mtp"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(MID, num_nextn_predict_layers=1)))
    plan = compile_plan(str(d), tmp_path, "dp=4,tp=2", "fp8", "--speculative-algorithm", "EAGLE")
    assert [(c["kind"], c["rows_per_rank"], c["draft_tokens"]) for c in plan["compiled"]] == [
        ("spec-decode", 64, 3), ("spec-extend", 256, 3)]
    assert plan["kv_bytes"]["layers"] == MID["num_hidden_layers"] + 1
    for c in plan["compiled"]:
        assert abs(c["argument_vs_plan"]) < 0.03 and c["temp_bytes_without_pool_copies_per_device"] > 0, c


def test_a_weight_placed_differently_from_the_plan_shows(mid_model, tmp_path, monkeypatch):
    """The check can fail: routed experts replicated where the plan splits them."""
    import jaxdp.parallel.sharding as sharding

    spec = sharding.param_spec

    def replicate_experts(path, ndim, layout):
        return P() if "w_gate_up_ED2I" in path or "w_down_EID" in path else spec(path, ndim, layout)

    monkeypatch.setattr(sharding, "param_spec", replicate_experts)
    plan = compile_plan(mid_model, tmp_path, "tp=8", "fp8", "--compile-steps", "decode")
    assert [c["kind"] for c in plan["compiled"]] == ["decode"]
    experts = {w["name"]: w for w in plan["plan"]["weights"]}["routed experts"]["bytes_total"]
    for c in plan["compiled"]:
        planned = c["planned_weight_bytes_per_device"] + c["planned_kv_bytes_per_device"]
        excess = c["argument_bytes_per_device"] - planned
        assert c["argument_vs_plan"] > 0.03 and abs(excess / (experts * 7 / 8) - 1) < 0.01


@pytest.mark.parametrize("preset, mesh, expert_dtype", [
    ("deepseek-v3", "dp=8", "fp8"), ("deepseek-v3", "tp=8", "fp8"), ("deepseek-v3", "dp=8,moe=ep", "fp8"),
    ("glm-5", "dp=4", "nvfp4"), ("glm-5", "tp=4", "nvfp4")])
def test_the_plan_counts_what_the_loader_holds_at_full_size(preset, mesh, expert_dtype):
    """Component by component dtype and placement: the planner's weights per device against the loader's
    description of every parameter (shape, dtype, PartitionSpec) for the real model, no XLA compile. A
    block-FP8 checkpoint holds attention, shared expert and dense layers in FP8 too (a planner counting
    them in bf16 is 12% over for DeepSeek-V3 at dp=8)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding

    from jaxdp.config import PRESETS
    from jaxdp.layout import parse_mesh_spec
    from jaxdp.model.sharded import param_table
    from jaxdp.planner.compile import QUANTIZATION
    from jaxdp.planner.weights import total_bytes, weights_per_device

    cfg = PRESETS[preset]
    layout = parse_mesh_spec(mesh, 8 if preset == "deepseek-v3" else 4)
    device_mesh = layout.make_mesh(jax.devices()[: layout.total_devices])
    table = param_table(cfg, layout, jnp.bfloat16, QUANTIZATION[expert_dtype])
    held = sum(int(np.prod(NamedSharding(device_mesh, i.spec).shard_shape(i.shape))) * i.dtype.itemsize
               for i in table.values())
    planned = total_bytes(weights_per_device(cfg, layout, expert_dtype, placement="jaxdp"))
    assert abs(held / planned - 1) < 0.002, (held / 2**30, planned / 2**30)


def test_fp8_weights_that_do_not_split_into_whole_blocks_are_refused(tmp_path, capsys):
    """As the loader refuses them: 512-wide experts over 8 devices are 64 wide, half a 128-wide scale block."""
    d = tmp_path / "narrow"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**MID, "moe_intermediate_size": 512}))
    argv = ["--model", str(d), "--gpus", "8", "--gpu", "H200", "--mesh", "tp=8", "--expert-dtype", "fp8", "--compile"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "whole 128-wide scale blocks over 8 devices" in err and "Traceback" not in err


def test_speculating_with_a_model_without_an_mtp_layer_is_one_sentence(mid_model, capsys):
    """--speculative-algorithm drafts with the model's MTP layer: a config.json or a preset without one is
    refused before anything compiles, as is --speculative-num-steps alone."""
    for model, extra in ((mid_model, ["--speculative-algorithm", "EAGLE"]),
                         ("tiny", ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"])):
        argv = ["--model", model, "--gpus", "8", "--gpu", "H200", "--mesh", "dp=8", "--compile", "--compile-target",
                "cpu", *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, err
        assert "drafts with the model's MTP (NextN) layer, and " in err and "has none (num_nextn_predict_layers" in err
    assert main(["--model", mid_model, "--gpus", "8", "--mesh", "dp=8", "--speculative-num-steps", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("plan: error: --speculative-num-steps needs --speculative-algorithm "
                                               "(EAGLE or NEXTN).")
