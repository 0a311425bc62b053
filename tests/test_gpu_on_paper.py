"""The GPU on paper: `plan --compile` compiles the engine's steps with XLA:GPU for 8 simulated H200s (no GPU,
no CUDA driver), taking the GPU's own paths (Pallas kernels as Triton custom calls, ragged all-to-all for EP,
XLA:GPU's fusions), and checks the optimized program (jaxdp.planner.hlo_checks).

Needs the CUDA plugin's two wheels at JAX's version (`pip install -e ".[xla-gpu]"`; docs/gpu-on-paper.md);
skipped without them. A small model (hidden 1024, 48 experts, 3 layers) keeps each compile to seconds; its
row counts (24 decode, 200 prompt rows per rank) and experts per device (6 under EP) are chosen not to
coincide with its widths, so the checks' shapes are unambiguous. The steps compiled (tests/test_xla_gpu.py runs
them in the suite): the three of one DP-attention + EP layout in block FP8 (a module fixture: ragged
all-to-all, the MLA decode kernel and every FP8 GEMM in one program), and a 512-row decode step with NVFP4
experts that does not fit (the NVFP4 grouped GEMM in a step, and the refusal); the two speculative steps
with the MTP layer (--speculative-algorithm EAGLE); a decode step on 16 GPUs (two simulated nodes) with redundant
experts; and the split-pool decode step of --dcp-size 8.
"""

import json

import pytest

from jaxdp.planner.capacity import main
from jaxdp.planner.xla_target import plugin_installed

needs_plugin = pytest.mark.skipif(
    not plugin_installed(), reason="XLA:GPU's CUDA plugin is not on this process's path: CI runs these through "
    "tests/test_xla_gpu.py (the xla-gpu extra installed apart); here: pip install -e '.[xla-gpu]'")

SMALL = {"model_type": "deepseek_v3", "vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2048,
         "moe_intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 16,
         "num_key_value_heads": 16, "q_lora_rank": 256, "kv_lora_rank": 256, "qk_nope_head_dim": 64,
         "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 48, "n_shared_experts": 1,
         "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
         "first_k_dense_replace": 1}
# block FP8 (every Linear of the layers in 128 x 128 blocks): widths that split into whole blocks over 8 devices
SMALL_FP8 = dict(SMALL, moe_intermediate_size=1024, v_head_dim=128)
STEPS = ["--decode-rows", "24", "--extend-rows", "200", "--context", "256"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    (d / "config.json").write_text(json.dumps(SMALL))
    return str(d)


def plan_gpu(model, tmp_path, mesh, *extra, memory="2GiB"):
    out = tmp_path / "plan.json"
    argv = ["--model", model, "--gpus", "8", "--gpu", "H200", "--gpu-memory", memory, "--mesh", mesh,
            "--compile", "--compile-target", "gpu", *STEPS, *extra, "--json", str(out)]
    code = main(argv)
    return code, (json.loads(out.read_text()) if code == 0 else None)


@pytest.fixture(scope="module")
def ep_plan(tmp_path_factory):
    """DP attention with EP MoE, block-FP8 weights: decode and both extend modes, the GPU's defaults."""
    d = tmp_path_factory.mktemp("ep")
    (d / "config.json").write_text(json.dumps(SMALL_FP8))
    code, plan = plan_gpu(str(d), d, "dp=8,moe=ep", "--expert-dtype", "fp8")
    assert code == 0
    return plan


@needs_plugin
def test_the_steps_compile_for_simulated_h200s_on_the_gpu_paths(ep_plan):
    from jaxdp.planner.compile import format_compiled

    c = ep_plan["compile"]
    assert (c["target"], c["backend"], c["device_kind"]) == ("gpu", "gpu", "NVIDIA H200")
    assert (c["attention_backend"], c["moe_runner_backend"]) == ("pallas", "pallas")
    assert c["target_description"]["compute_capability"] == "9.0"
    steps = {(s["kind"], s["gather_mode"]): s for s in ep_plan["compiled"]}
    assert set(steps) == {("decode", "max_len"), ("extend", "max_len"), ("extend", "sum_len")}
    for s in steps.values():
        planned = s["planned_weight_bytes_per_device"] + s["planned_kv_bytes_per_device"]
        assert abs(s["argument_bytes_per_device"] / planned - 1) < 0.03, s
        assert s["temp_bytes_per_device"] > 0 and s["cost"]["flops"] > 0 and s["cost"]["floor_ms"] > 0
        assert s["cost"]["estimate_ms"] > 0 and s["cost"]["source"] in ("XLA", "HLO")
        checks = s["checks"]
        assert checks["experts"]["ok"] and checks["fp8_weights"]["ok"], checks
        # EP dispatch is ragged_all_to_all on a GPU, asynchronous like every collective of the step
        col = checks["collectives"]
        assert col["ok"] and not col["sync"] and "ragged-all-to-all" in {p["op"] for p in col["pairs"]}, col
        assert checks["kernels"]["ok"], checks["kernels"]
        names = {k["name"] for k in checks["kernels"]["found"]}
        # experts, router and Linear weights in place; MLA's kv_b_proj per head in the absorbed decode (the
        # small prompt steps expand the latents in one piece, prefill.attend_dense: the dense FP8 GEMM)
        want = {"fp8_grouped_matmul", "fp8_matmul", "stacked_matmul"}
        want |= {"fp8_head_matmul"} if s["kind"] == "decode" else set()
        assert want <= names, names
        assert checks["layer_copies"]["ok"], checks["layer_copies"]  # no layer copied out of its stack
    # the decode kernel's grid: (16 heads / block 16, splits to fill 132 SMs, 24 rows)
    decode = steps[("decode", "max_len")]["checks"]["kernels"]
    assert decode["grids"]["mla_decode_split"] == [[1, 8, 24]]
    # a prompt step's one-row sequences (other ranks' decoders, relabeled) in blocks of up to 16
    # (MLA.attend_one_rows); this extend step has one sequence slot, so blocks of one
    extend = steps[("extend", "max_len")]["checks"]["kernels"]["grids"]["mla_decode_split"]
    assert extend == [[1, 8, 1]], extend
    out = "\n".join(format_compiled(ep_plan))
    assert "Compiled by XLA:GPU for 8 simulated NVIDIA H200 (sm_90)" in out and "checks of decode 24 max_len" in out
    assert "HBM floor" in out
    assert not [line for line in out.splitlines() if line.strip().startswith("FAIL")]


@needs_plugin
def test_block_fp8_weights_are_multiplied_in_place_by_the_pallas_gemms(ep_plan):
    """DeepSeek's block FP8 (every Linear weight of the layers, 128 x 128 blocks): the projections, the dense FFN
    and shared expert run the Pallas FP8 GEMM, the routed experts its grouped form, the router the plain one,
    MLA's kv_b_proj the per-head one (q_nope . W_UK and W_UV of the absorbed decode), each reading its layer from
    the stack: no layer copied, no FP8 weight widened (the decode step of the EP layout)."""
    checks = ep_plan["compiled"][0]["checks"]
    assert ep_plan["compiled"][0]["kind"] == "decode"
    assert checks["kernels"]["ok"] and checks["layer_copies"]["ok"] and checks["fp8_weights"]["ok"], checks
    grids = checks["kernels"]["grids"]
    # experts: the ragged all-to-all's receive buffer (24 rows x top-8 x 8 ranks) / 16 + 6 experts row tiles,
    # [2 x 1024 | 1024] / 64; router: the rank's 24 rows, 48 experts
    assert grids["fp8_grouped_matmul"] == [[102, 16, 1], [102, 32, 1]], grids
    assert grids["fp8_matmul"] and grids["stacked_matmul"] == [[1, 3, 1]], grids
    # kv_b_proj per head: (24 rows / 64, 16 heads, 128 values / 64 | 256 latent / 64)
    assert grids["fp8_head_matmul"] == [[1, 16, 2], [1, 16, 4]], grids


@needs_plugin
def test_the_speculative_steps_compile_with_the_mtp_layer_and_pass_the_checks(tmp_path):
    """--speculative-algorithm EAGLE --speculative-num-steps 2: the server's two speculative steps (the decode
    bucket's 24 requests verifying 3 rows each in the absorbed form; a 200-row extend step), with the MTP layer's
    abstract weights in their sharding and its draft KV in the pool, every check passing: the MLA decode kernel
    runs the verify (72 rows) and the chained draft (24, in both forms), the MTP layer's FP8 experts in the grouped
    GEMM (given the layers' runner backend: the FP8 check fails without it), its layer in place."""
    d = tmp_path / "mtp"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(SMALL_FP8, num_nextn_predict_layers=1)))
    code, plan = plan_gpu(str(d), d, "dp=8,moe=ep", "--expert-dtype", "fp8", "--speculative-algorithm", "eagle",
                          "--speculative-num-steps", "2")
    assert code == 0
    assert plan["speculative"] == {"algorithm": "EAGLE", "num_steps": 2, "num_draft_tokens": 3}
    assert "MTP layer (NextN)" in {w["name"] for w in plan["plan"]["weights"]}
    assert plan["kv_bytes"]["layers"] == 4  # 3 layers and the draft KV's
    steps = {s["kind"]: s for s in plan["compiled"]}
    assert list(steps) == ["spec-decode", "spec-extend"] and plan["compile"]["draft_tokens"] == 2
    assert (steps["spec-decode"]["rows_per_rank"], steps["spec-extend"]["rows_per_rank"]) == (72, 200)
    for s in steps.values():
        planned = s["planned_weight_bytes_per_device"] + s["planned_kv_bytes_per_device"]
        assert abs(s["argument_bytes_per_device"] / planned - 1) < 0.03, s
        assert all(c["ok"] for c in s["checks"].values()), s["checks"]
        names = {k["name"] for k in s["checks"]["kernels"]["found"]}
        assert {"fp8_grouped_matmul", "fp8_matmul", "fp8_head_matmul", "mla_decode_split"} <= names, names
        assert "ragged-all-to-all" in {p["op"] for p in s["checks"]["collectives"]["pairs"]}
    grids = {k: s["checks"]["kernels"]["grids"]["mla_decode_split"] for k, s in steps.items()}
    # the verify's rows, the chained drafts' (one a request), and the spec-extend's one-row sequences, 16 at a time
    assert grids == {"spec-decode": [[1, 4, 72], [1, 8, 24]], "spec-extend": [[1, 8, 16], [1, 8, 24]]}, grids


@needs_plugin
def test_redundant_expert_slots_compile_on_two_simulated_nodes(tmp_path):
    """--ep-num-redundant-experts on 16 GPUs: two simulated nodes of 8 (each a process of its own, as a multi-node
    deployment runs), dp=16,moe=ep with 16 redundant slots (48 + 16 = 64 slots, 4 a GPU): XLA:GPU's arguments are
    the plan's weights (the slots and the expert map) and pool, and the grouped GEMM's grid counts a GPU's 4 slots,
    not its 3 experts (the check fails on 3: a row tile more per slot)."""
    d = tmp_path / "fp8"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMALL_FP8))
    out = tmp_path / "plan.json"
    argv = ["--model", str(d), "--gpus", "16", "--gpu", "H200", "--gpu-memory", "2GiB", "--mesh", "dp=16,moe=ep",
            "--expert-dtype", "fp8", "--placement", "jaxdp", "--ep-num-redundant-experts", "16", "--compile",
            "--compile-target", "gpu", "--compile-steps", "decode", *STEPS, "--json", str(out)]
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    assert (plan["compile"]["host_devices"], plan["compile"]["nodes"]) == (16, 2)
    assert "redundant experts" in {w["name"] for w in plan["plan"]["weights"]}
    (step,) = plan["compiled"]
    assert abs(step["argument_vs_plan"]) < 0.03, step["argument_vs_plan"]
    assert all(c["ok"] for c in step["checks"].values()), step["checks"]
    assert step["checks"]["experts"]["experts_per_device"] == 4
    # the ragged all-to-all's receive buffer: 24 rows x top-8 x 16 ranks / 16 + 4 slots row tiles, [2 x 1024 |
    # 1024] / 64
    assert step["checks"]["kernels"]["grids"]["fp8_grouped_matmul"] == [[196, 16, 1], [196, 32, 1]]


@needs_plugin
def test_the_split_pool_steps_collectives_are_the_ones_the_plan_counts(small_model, tmp_path):
    """--dcp-size 8 under tp=8 (docs/dcp.md): the decode step compiled by XLA:GPU moves, in every layer, the
    subgroup's queries (all-gather), their log-sum-exps (all-gather, float32) and the rescaled partial outputs
    (reduce-scatter, float32) with the buffers `jaxdp.planner.dcp` counts, read from the optimized HLO; the pool
    on a device is 1/8 of the group's tokens (arguments within 3% of the plan); attention is XLA's partial form,
    not the MLA decode kernel."""
    out = tmp_path / "plan.json"
    argv = ["--model", small_model, "--gpus", "8", "--gpu", "H200", "--gpu-memory", "2GiB", "--tp-size", "8",
            "--dcp-size", "8", "--rows", "24", "--compile", "--compile-target", "gpu", "--compile-steps", "decode",
            *STEPS, "--json", str(out)]
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    dcp = plan["plan"]["dcp"]
    assert dcp["tokens_per_group"] == 8 * dcp["tokens_per_device"] == plan["plan"]["kv_tokens_per_rank"]
    (step,) = plan["compiled"]
    assert abs(step["argument_vs_plan"]) < 0.03, step["argument_vs_plan"]
    assert all(c["ok"] for c in step["checks"].values()), step["checks"]
    assert "mla_decode_split" not in {k["name"] for k in step["checks"]["kernels"]["found"]}
    compiled = {(c["op"], c["bytes"]): c["count"] for c in step["collectives"]}
    assert len(dcp["collectives"]) == 3
    for c in dcp["collectives"]:  # one each a layer (3 layers)
        assert compiled.get((c["op"], c["buffer_bytes"])) == c["calls"] == 3, (c, step["collectives"])


def test_more_gpus_than_a_node_are_simulated_as_nodes_of_eight():
    from jaxdp.planner.xla_target import TargetError, node_topology

    assert [node_topology(n) for n in (1, 8, 16, 32)] == ["1x1x1", "1x1x8", "1x2x8", "1x4x8"]
    with pytest.raises(TargetError, match=r"^12 GPUs do not make whole nodes of 8; use a multiple of 8 with --gpus"):
        node_topology(12)


@needs_plugin
def test_the_checks_fail_on_the_xla_expert_path():
    """What the xla MoE runner (--moe-runner-backend xla) makes of NVFP4 experts, compiled by XLA:GPU: a layer of
    the stacks dequantized to bf16 outside any dot, then `lax.ragged_dot`, expanded per expert; the experts and
    quantized-weights checks say so (the model's own function, without a whole step to compile)."""
    import jax
    import jax.numpy as jnp

    from jaxdp.ops.experts import nvfp4_matmul_xla as _nvfp4_matmul_xla
    from jaxdp.planner.hlo_checks import check_experts, check_fp8_weights, parse
    from jaxdp.planner.xla_target import compile_for_gpu

    spec = jax.ShapeDtypeStruct
    layers, e, n, k, t = 3, 6, 512, 1024, 200
    compiled = compile_for_gpu(lambda x, p, s, g, sizes, i: _nvfp4_matmul_xla(x, p[i], s[i], g[i], sizes),
                               spec((t, k), jnp.bfloat16), spec((layers, e, n, k // 2), jnp.uint8),
                               spec((layers, e, n, k // 16), jnp.float8_e4m3fn), spec((layers, e), jnp.float32),
                               spec((e,), jnp.int32), spec((), jnp.int32))
    mod = parse(compiled.as_text())
    experts = check_experts(mod, e, {t}, {n, k})  # (the widths: the experts' output and the hidden size)
    assert not experts["ok"] and any(",6," in x["shape"] for x in experts["expanded"]), experts
    widened = check_fp8_weights(mod)
    assert not widened["ok"] and widened["copies"][0]["shape"].startswith("bf16[6,"), widened


@needs_plugin
def test_a_layout_whose_temp_does_not_fit_is_one_sentence_with_a_layout_that_fits(small_model, tmp_path, capsys):
    """NVFP4 experts' weights well inside the plan's budget (0.04 of 0.88 x 0.17 GiB), but not beside XLA:GPU's
    temp of a 512-row decode step under DP attention (0.14 GiB: the LM head's logits of every rank's rows): one
    sentence, and the layout it names holds its weights beside that temp. The step, compiled all the same (its
    figures in the JSON), runs the NVFP4 grouped GEMM with its grid and passes every check."""
    decode = ["--compile-steps", "decode", "--decode-rows", "512", "--expert-dtype", "nvfp4"]
    code, plan = plan_gpu(small_model, tmp_path, "dp=8", *decode, memory="0.17GiB")
    record = json.loads((tmp_path / "plan.json").read_text())  # --json keeps the figures
    fit, memory = record["compile"]["fit"], 0.17 * 2**30
    assert code == 2 and plan is None and fit["xla_weight_bytes_per_device"] < 0.88 * memory
    assert fit["xla_weight_bytes_per_device"] + fit["largest_temp_bytes_per_device"] > memory
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("plan: error: under dp=8 x tp=1") and "XLA:GPU's temp of the decode 512 max_len" in err
    assert "more than the 0.17 GiB of a H200, leaving no room for a KV cache" in err, err
    assert "use fewer --decode-rows, or a layout that fits: --gpus 8 --mesh " in err, err
    named = float(err.rsplit("(", 1)[1].split(" GiB")[0]) * 2**30  # its weights per GPU
    assert named + fit["largest_temp_bytes_per_device"] < memory
    checks = record["compiled"][0]["checks"]
    assert all(c["ok"] for c in checks.values()), checks
    # 512 rows x 8 ranks x top-8 / 16 + 48 experts row tiles, [2 x 256 / 8 | 1024] / 64 (a layout that fits, at
    # size: docs/gpu-on-paper.md)
    assert checks["kernels"]["grids"]["nvfp4_grouped_matmul"] == [[2096, 1, 1], [2096, 16, 1]]


@needs_plugin
def test_flops_and_bytes_counted_from_the_gpu_hlo():
    """XLA's cost analysis answers None for simulated GPUs; the count from the optimized HLO gives a GEMM's
    2 x M x N x K and a layer scan's trip count times one layer; the layer_copies check sees a stacked
    weight's layer copied out of the stack."""
    import jax
    import jax.numpy as jnp

    from jaxdp.planner.hlo_checks import check_layer_copies, parse
    from jaxdp.planner.hlo_cost import hlo_cost
    from jaxdp.planner.xla_target import compile_for_gpu

    m, k, n, layers = 4096, 512, 256, 6  # many rows: no split-K partial sums
    x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((layers, k, k), jnp.bfloat16)
    one = compile_for_gpu(lambda x, w: x @ w[0, :, :n], x, w)
    assert one.cost_analysis() is None  # why the planner counts
    cost = hlo_cost(parse(one.as_text()))
    assert cost["flops"] == 2 * m * n * k
    assert cost["bytes accessed"] == (m * k + k * n + m * n) * 2  # x, one layer's slice of w, the result

    def scan(x, w):
        return jax.lax.scan(lambda h, w_l: ((h @ w_l).astype(h.dtype), None), x, w)[0]

    m, k = 64, 2048  # the weights dominate: 8 MiB a layer, 48 MiB the stack
    x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((layers, k, k), jnp.bfloat16)
    mod = parse(compile_for_gpu(scan, x, w).as_text())
    cost = hlo_cost(mod)
    assert cost["flops"] == layers * 2 * m * k * k
    # XLA:GPU copies each layer out of the stack before its GEMM (write + read again: 3 x the weights), and
    # splits K with float32 partial sums; the whole stack read in every layer would be 18 x
    weights = layers * k * k * 2
    assert 3 * weights <= cost["bytes accessed"] < 5 * weights
    copies = check_layer_copies(mod)
    assert not copies["ok"] and copies["copies"][0]["shape"] == f"bf16[1,{k},{k}]", copies


def test_a_gpu_without_a_target_description_is_one_sentence(small_model, capsys):
    for gpu in ("L4", "mygpu:96:4.0:700:450"):
        argv = ["--model", small_model, "--gpus", "8", "--gpu", gpu, "--mesh", "dp=8", "--compile",
                "--compile-target", "gpu"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "no XLA:GPU target description for GPU" in err, err
        assert "(shipped: B200, B300, H100, H200); use --gpu with one of them, or --compile-target cpu." in err


def test_without_the_plugin_the_gpu_target_says_what_to_install(small_model, capsys, monkeypatch):
    from jaxdp.planner import xla_target

    monkeypatch.setattr(xla_target, "plugin_installed", lambda: False)
    assert xla_target.default_target() == "cpu"
    argv = ["--model", small_model, "--gpus", "8", "--gpu", "H200", "--mesh", "dp=8", "--compile",
            "--compile-target", "gpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'pip install "jax-cuda12-plugin==<jax version>"' in err, err


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize("mesh, extra", [("dp=8", []), ("tp=8", []), ("dp=8,moe=ep", []),
                                         ("dp=8", ["--speculative-algorithm", "EAGLE"])])
def test_deepseek_v3_fp8_on_8_h200s_at_full_size(mesh, extra, tmp_path):
    """docs/gpu-on-paper.md: the full model on abstract weights, 1-2 minutes and < 1 GiB of host memory each.
    XLA:GPU's arguments are the plan's weights and pool; every check holds in every step: the kernels, the
    experts, the collectives, no layer copied out of its stack and every FP8 weight widened in the Pallas GEMMs'
    registers (MLA's kv_b_proj by the per-head one)."""
    out = tmp_path / "plan.json"
    argv = ["--model", "deepseek-v3", "--gpus", "8", "--gpu", "H200", "--mesh", mesh, "--expert-dtype", "fp8",
            "--compile", "--compile-target", "gpu", *extra, "--json", str(out)]
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    assert plan["compile"]["fit"]["fits"]
    for c in plan["compiled"]:
        assert abs(c["argument_vs_plan"]) < 0.03, c["argument_vs_plan"]
        assert all(check["ok"] for check in c["checks"].values()), c["checks"]
        assert c["cost"]["estimate_ms"] > c["cost"]["floor_ms"] > 0
        names = {k["name"] for k in c["checks"]["kernels"]["found"]}
        assert {"fp8_matmul", "fp8_grouped_matmul", "stacked_matmul", "fp8_head_matmul"} <= names, names
    decode = plan["compiled"][0]
    assert decode["kind"] == ("spec-decode" if extra else "decode")
    assert decode["checks"]["kernels"]["grids"]["mla_decode_split"]
