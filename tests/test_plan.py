"""The planner reproduces the article's memory and roofline figures for GLM-5.3 on 4 B300s."""

import json
import sys

import pytest

from jaxdp.planner.capacity import main
from jaxdp.planner.gpus import GPUError, get_gpu, parse_memory

GiB = 2**30
ARTICLE = ["--model", "glm-5", "--gpus", "4", "--gpu", "B300", "--gpu-memory", "269GiB", "--mesh", "dp=4",
           "--expert-dtype", "nvfp4", "--kv-dtype", "fp8", "--match-tp-tokens", "2.68M"]


def run(tmp_path, *extra):
    out = tmp_path / "plan.json"
    assert main([*ARTICLE, *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return run(tmp_path_factory.mktemp("plan"))


def near(value, target, rel):
    return abs(value / target - 1) <= rel


def test_weights_per_gpu(plan):
    dp, tp = plan["plan"]["weights_per_device_gib"], plan["tp"]["weights_per_device_gib"]
    assert near(tp, 106.6, 0.03) and near(dp, 125.7, 0.03)
    assert abs((dp - tp) - 19.1) <= 1.5
    attn = {w["name"]: w for w in plan["plan"]["weights"]}["attention projections"]
    assert round(attn["bytes_total"] / GiB) == 24  # "24 GB for all 78 layers"
    assert round(attn["params"] / plan["config"]["num_layers"] / 1e6) == 165


def test_lm_head_and_dp_lm_head(plan, tmp_path):
    head = {w["name"]: w for w in plan["plan"]["weights"]}["LM head"]
    assert round(head["bytes_total"] / GiB, 1) == 1.8
    whole = run(tmp_path, "--mesh", "dp=4,lm_head=dp")
    extra = whole["plan"]["weights_per_device_gib"] - plan["plan"]["weights_per_device_gib"]
    assert round(extra, 1) == 1.3


def test_kv_capacity(plan):
    assert plan["row_bytes"] == 12_288
    assert plan["tp"]["kv_tokens_per_rank"] == plan["tp"]["kv_tokens_total"] == 2_680_000
    assert near(plan["plan"]["kv_tokens_per_rank"], 2.25e6, 0.05)
    assert near(plan["plan"]["kv_tokens_total"], 9.0e6, 0.05)


def test_situations_in_the_plan(plan):
    s = plan["plan"]["situations"]
    assert [round(s[n]["experts_sglang"]["ratio"], 1) for n in s] == [1.0, 4.0, 2.5, 3.7, 1.0]
    assert s["balanced"]["gathered_bytes"] == 768 * 2**10 and s["long_prompt"]["gathered_rows"] == 4144
    assert plan["tp"]["situations"]["balanced"]["rows"] == [64]


def test_roofline_explains_the_single_request(plan):
    tp = plan["tp"]["roofline"]["single"]["sglang"]
    dp = plan["plan"]["roofline"]["single"]["sglang"]
    terms_tp = {t["name"]: t["ms"] for t in tp["terms"]}
    terms_dp = {t["name"]: t["ms"] for t in dp["terms"]}
    # one GPU reading all 24 GiB of attention weights: about 3.3 ms on a B300
    assert near(terms_dp["attention projections"], 3.3, 0.1)
    diff = {k: terms_dp[k] - terms_tp[k] for k in terms_tp}
    assert max(diff, key=diff.get) == "attention projections"
    assert diff["attention projections"] > 0.5 * (dp["ms"] - tp["ms"])
    assert dp["ms"] > tp["ms"] and dp["ms"] < 12.2 and tp["ms"] < 6.6  # a floor below the measurements
    jax_dp = plan["plan"]["roofline"]["single"]["jaxdp"]
    assert jax_dp["ms"] < dp["ms"]  # padding rows do not reach the experts


def test_report_and_plot(tmp_path, capsys):
    png = tmp_path / "five.png"
    assert main([*ARTICLE, "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "article (measured)" in text and "768.0 KiB" in text and "48.6 MiB" in text
    assert png.stat().st_size > 10_000


def test_plot_without_matplotlib_is_one_sentence(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (what `import matplotlib` finds where it is not installed)
    png = tmp_path / "five.png"
    assert main([*ARTICLE, "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert err == 'plan: error: --plot needs matplotlib: pip install "jaxdp[bench]" (or matplotlib), or leave ' \
                  "--plot out.\n"
    assert not png.exists()


def test_rows_and_other_layouts(tmp_path):
    out = tmp_path / "p.json"
    assert main(["--model", "deepseek-v3", "--gpus", "8", "--gpu", "H200", "--mesh", "dp=4,tp=2",
                 "--expert-dtype", "fp8", "--rows", "8,8,8,8", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert list(plan["plan"]["situations"]) == ["rows"] and plan["plan"]["kv_tokens_total"] > 0
    assert plan["tp"]["situations"]["rows"]["rows"] == [32]
    flags = tmp_path / "f.json"
    assert main(["--model", "deepseek-v3", "--gpus", "8", "--gpu", "H200", "--tp-size", "8",
                 "--attn-dp-size", "4", "--expert-dtype", "fp8", "--json", str(flags)]) == 0
    assert json.loads(flags.read_text())["plan"]["layout"] == plan["plan"]["layout"]


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "4", "--mesh", "dp=3"], "--gpus"),
    (["--gpus", "8", "--tp-size", "8", "--attn-dp-size", "3"], "divide"),
    (["--gpus", "4", "--mesh", "dp=4", "--gpu", "Z9"], "unknown GPU"),
    (["--gpus", "1", "--mesh", "dp=1", "--gpu", "H100", "--model", "deepseek-v3"], "1251.8 GiB per GPU but 70.4"),
    (["--gpus", "4", "--mesh", "dp=4", "--rows", "1,2"], "--rows"),
    (["--gpus", "4", "--mesh", "dp=4", "--model", "no-such-model"], "preset"),
    (["--gpus", "4"], "--mesh"),
    (["--mesh", "dp=4"], "--gpus"),
    (["--gpus", "4", "--mesh", "dp=4", "--expert-dtype", "nvfp4", "--compile", "--kv-dtype", "fp8"], "--kv-dtype bf16"),
    (["--gpus", "4", "--mesh", "dp=4", "--expert-dtype", "nvfp4", "--compile", "--compile-steps", "x"], "decode,"),
    (["--gpus", "4", "--mesh", "dp=4", "--compile", "--extend-rows", "0"], "must be positive"),
    (["--gpus", "4", "--mesh", "dp=4", "--ep-num-redundant-experts", "4"], "needs expert parallelism"),
    (["--gpus", "8", "--mesh", "dp=8,moe=ep", "--model", "deepseek-v3", "--expert-dtype", "fp8",
      "--ep-num-redundant-experts", "4"], "do not split over 8 devices"),
    (["--gpus", "8", "--mesh", "dp=8,moe=ep", "--model", "deepseek-v3", "--expert-dtype", "fp8",
      "--balancedness", "1.5"], "(0, 1]"),
    (["--gpus", "4", "--mesh", "dp=4", "--balancedness", "0.5"], "under expert parallelism"),
])
def test_user_errors_exit_2_with_one_line(argv, words, capsys):
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err and "Traceback" not in err


def test_a_layout_that_does_not_fit_names_one_that_does(capsys, tmp_path):
    argv = ["--model", "deepseek-v3", "--gpu", "H100", "--expert-dtype", "fp8"]
    assert _exit_code([*argv, "--gpus", "8", "--mesh", "dp=8"]) == 2
    err = capsys.readouterr().err
    assert "91.3 GiB per GPU but 70.4 GiB are available" in err
    advice = err.split("a layout that fits: ")[1].split(" (")[0].split()
    assert advice == ["--gpus", "16", "--mesh", "dp=16,tp=1"]
    out = tmp_path / "fits.json"
    assert main([*argv, *advice, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["plan"]["fits"]


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


def test_gpu_presets_and_custom():
    assert get_gpu("h200").memory_gib == 141 and get_gpu("B300").hbm_tbs == 8
    custom = get_gpu("mine:96:4.0:700:450")
    assert (custom.memory_gib, custom.hbm_tbs, custom.bf16_tflops, custom.link_gbs) == (96, 4.0, 700, 450)
    assert parse_memory("269GiB") == 269 and round(parse_memory("80GB"), 2) == 74.51
    with pytest.raises(GPUError):
        get_gpu("mine:x:1:1")


def test_placement_rules_sglang_and_jaxdp():
    from jaxdp.config import get_config
    from jaxdp.layout import Layout
    from jaxdp.planner.weights import weights_per_device

    cfg = get_config("glm-5")

    def per_device(layout, placement):
        comps = weights_per_device(cfg, layout, "nvfp4", placement=placement)
        return {c.name: c.bytes_per_device for c in comps}

    tp_s, tp_j = per_device(Layout(tp=4), "sglang"), per_device(Layout(tp=4), "jaxdp")
    assert tp_s["embedding"] * 4 == tp_j["embedding"]  # SGLang splits it under TP, jaxdp keeps it whole
    assert "absorbed copies (w_kc, w_vc)" in tp_s and "absorbed copies (w_kc, w_vc)" not in tp_j
    ep = per_device(Layout(dp=4, moe="ep", dense_replicated=True), "sglang")
    dp = per_device(Layout(dp=4), "sglang")
    assert ep["shared expert"] == 4 * dp["shared expert"] and ep["dense layers"] == 4 * dp["dense layers"]
    assert ep["routed experts"] == dp["routed experts"]  # 64 whole experts = a quarter of each


@pytest.mark.parametrize("module", ["jaxdp.plan", "jaxdp.planner"])
def test_both_commands_run_the_planner(module):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", module, "--gpus", "4", "--mesh", "dp=4", "--gpu", "Z9"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown GPU" in out.stderr


def test_the_disaggregated_hand_off_of_a_prompt(tmp_path):
    """DeepSeek-V3 hands 576 bf16 values a layer for 61 layers per token (about 69 KiB) from the prefill
    server to the decode server: an 8k prompt is 549 MiB, 11.5 ms at 50 GB/s."""
    out = tmp_path / "plan.json"
    assert main(["--model", "deepseek-v3", "--gpus", "8", "--gpu", "H200", "--mesh", "dp=8", "--expert-dtype", "fp8",
                 "--handoff-gbs", "50", "--handoff-prompts", "1024,8192", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["kv_bytes_per_token"] == 576 * 2 * 61
    one_k, eight_k = plan["handoff"]["prompts"]
    assert eight_k["tokens"] == 8192 and eight_k["bytes"] == 8192 * 576 * 2 * 61
    assert near(eight_k["ms"], 8192 * 70272 / 50e9 * 1e3, 1e-9) and near(eight_k["ms"], 11.5, 0.01)
    assert one_k["bytes"] * 8 == eight_k["bytes"]


def test_a_bad_hand_off_prompt_list_is_one_sentence(capsys):
    assert main([*ARTICLE, "--handoff-prompts", "1k"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--handoff-prompts '1k' must be prompt lengths" in err


V3_EP = ["--model", "deepseek-v3", "--gpus", "8", "--gpu", "H200", "--mesh", "dp=8,moe=ep", "--expert-dtype", "fp8"]


def test_redundant_experts_memory_and_the_most_loaded_gpu(tmp_path):
    """--ep-num-redundant-experts 32 on 8 GPUs: 4 more whole experts a GPU in every MoE layer; --balancedness b
    prices the routed experts on the most loaded GPU (1 / b of the mean GPU's pairs); TP is priced as before."""
    def v3(*extra):
        out = tmp_path / "p.json"
        assert main([*V3_EP, *extra, "--json", str(out)]) == 0
        return json.loads(out.read_text())

    def experts_ms(p):
        return next(t["ms"] for t in p["plan"]["roofline"]["batch"]["jaxdp"]["terms"] if t["name"] == "routed experts")

    prefill_sized = ("--rows", ",".join(["4096"] * 8))  # rows whose experts' FLOPs, not their bytes, set the time
    even, redundant = v3(*prefill_sized), v3(*prefill_sized, "--ep-num-redundant-experts", "32")
    half = v3(*prefill_sized, "--ep-num-redundant-experts", "32", "--balancedness", "0.5")
    weights = {w["name"]: w for w in redundant["plan"]["weights"]}
    routed = weights["routed experts"]["bytes_per_device"]
    assert near(weights["redundant experts"]["bytes_per_device"], routed * 4 / 32, 1e-9)  # 4 slots beside 32
    assert near(redundant["plan"]["weights_per_device_gib"] - even["plan"]["weights_per_device_gib"],
                routed * 4 / 32 / GiB, 1e-9)
    assert "redundant experts" not in {w["name"] for w in even["plan"]["weights"]}
    assert redundant["num_redundant_experts"] == 32 and half["balancedness"] == 0.5
    assert redundant["plan"]["kv_tokens_per_rank"] < even["plan"]["kv_tokens_per_rank"]
    # the most loaded GPU computes twice the mean's pairs at balancedness 0.5: the experts' term doubles
    assert near(experts_ms(half), 2 * experts_ms(redundant), 1e-6) and near(experts_ms(redundant), experts_ms(even),
                                                                              1e-6)
    assert half["tp"]["roofline"] == redundant["tp"]["roofline"] == even["tp"]["roofline"]


def test_the_ep_price_without_redundancy_is_the_uniform_one():
    """R = 0 and balancedness 1: the most-loaded-GPU price is the old uniform one (same bytes and FLOPs)."""
    from jaxdp.config import PRESETS
    from jaxdp.layout import Layout
    from jaxdp.planner.gpus import get_gpu as gpu_of
    from jaxdp.planner.roofline import decode_roofline, expected_experts
    from jaxdp.planner.weights import weights_per_device

    cfg, lay, rows = PRESETS["deepseek-v3"], Layout(dp=8, moe="ep"), (16,) * 8
    term = decode_roofline(cfg, lay, gpu_of("H200"), rows, expert_dtype="fp8", padding="jaxdp").term("routed experts")
    experts = next(c for c in weights_per_device(cfg, lay, "fp8") if c.name == "routed experts")
    E = cfg.n_routed_experts
    assert near(term.hbm_bytes, experts.bytes_total * expected_experts(128, E, 8) / E / 8, 1e-9)
    with pytest.raises(ValueError, match="moe=ep"):
        weights_per_device(cfg, Layout(dp=8), "fp8", num_redundant_experts=8)
