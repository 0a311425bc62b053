"""`python -m jaxdp.experiments`: bad command lines and a server that cannot start end in one `error:` line
(fast); each experiment's --quick run writes its JSON, PNG and markdown table (slow: minutes each)."""

import json
import math
from pathlib import Path

import pytest

from jaxdp.experiments import crossover, ep, recipes, single_request, skew
from jaxdp.experiments.__main__ import EXPERIMENTS, main


@pytest.mark.parametrize("argv, says", [
    (["skew", "--mesh", "dp=2"], "--mesh is chosen by the experiment itself"),
    (["skew", "--enable-prefill-delayer"], "--enable-prefill-delayer is chosen by the experiment itself"),
    (["skew", "--no-such-flag"], "'--no-such-flag' is not a flag of python -m jaxdp.serve"),
    (["no-such-experiment"], "invalid choice: 'no-such-experiment'"),
])
def test_bad_command_lines_are_one_error_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1


def test_a_server_that_cannot_start_is_one_error_line(tmp_path, capsys):
    assert main(["skew", "--quick", "--output-dir", str(tmp_path), "--model-path", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the server exited with status 2 before it was ready") and "none" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "skew.json").exists()


def positive(values) -> bool:
    values = list(values)
    return bool(values) and all(math.isfinite(v) and v > 0 for v in values)


def ranks(counts) -> dict[str, int]:
    return {str(r): c for r, c in enumerate(counts) if c}


def check_skew(r: dict) -> None:
    itl = r["median_itl_ms"]
    assert set(itl) == set(skew.PATTERNS) and positive(itl.values())
    assert r["itl_ratio_skewed_over_balanced"] == pytest.approx(itl["skewed"] / itl["balanced"])
    assert r["itl_ratio_one_rank_over_balanced"] == pytest.approx(itl["one rank"] / itl["balanced"])
    # every pattern's requests went to the ranks it pins them to, and each had a steady window
    assert {k: p["requests_per_dp_rank"] for k, p in r["steady"].items()} == {
        k: ranks(c) for k, c in skew.PATTERNS.items()}
    assert all(p["window_s"] > 0 and p["tokens_in_window"] > 0 for p in r["steady"].values())


def check_single_request(r: dict) -> None:
    itl, per_rank = r["median_itl_ms"], r["requests_per_dp_rank"]
    assert set(itl) == {*single_request.LAYOUTS, "dp=4, one per rank"} and positive(itl.values())
    assert r["itl_ratio_dp_over_tp"] == pytest.approx(itl["dp=4"] / itl["tp=4"])
    assert r["itl_ratio_four_over_one_dp4"] == pytest.approx(itl["dp=4, one per rank"] / itl["dp=4"])
    repeats = sum(per_rank["tp=4"].values())
    assert repeats > 0 and per_rank["tp=4"] == {"0": repeats}  # one dp rank under tp=4
    assert sum(per_rank["dp=4"].values()) == sum(per_rank["dp=2,tp=2"].values()) == repeats
    assert per_rank["dp=4, one per rank"] == ranks([repeats] * 4)


def check_prompt_in_the_way(r: dict) -> None:
    assert set(r["tests"]) == set(r["itl_series"]) and len(r["tests"]) == 4
    for name, t in r["tests"].items():
        # every prompt sent was read (a TTFT of nan hides prompts that never finished)
        assert t["prompts_sent"] > 0 and t["prompts_done"] == t["prompts_sent"], name
        assert positive([t["rate_alone"], t["prompt_ttft_s"], t["decode_step_ms_alone"], t["prompts_s"]]), name
        assert t["rate_prompts"] >= 0 and -100 < t["lost_pct"] <= 100, name
        assert t["lost_pct"] == pytest.approx(100 * (1 - t["rate_prompts"] / t["rate_alone"])), name
        assert r["itl_series"][name] and all(gap >= 0 for _, gap in r["itl_series"][name]), name
    assert r["decode_tokens_lost_pct"] == {"short": r["tests"]["pinned short"]["lost_pct"],
                                           "long": r["tests"]["pinned long"]["lost_pct"]}
    assert r["decode_tokens_lost_pct_with_delayer"] == r["tests"]["unpinned long, delayer"]["lost_pct"]


def check_ep(r: dict) -> None:
    for moe in ep.MESHES:
        assert set(r["median_itl_ms"][moe]) == set(ep.LOADS) and positive(r["median_itl_ms"][moe].values())
        for load, counts in ep.LOADS.items():
            rows = r["expert_rows_per_step"][moe][load]
            # jaxdp's experts compute the rows that exist; SGLang's TP MoE pads every rank to the busiest
            assert rows["jaxdp_computed"] == rows["needed"] == sum(counts), (moe, load)
            sglang = len(counts) * max(counts) if moe == "moe=tp" else sum(counts)
            assert rows["sglang_computed"] == sglang, (moe, load)


def check_crossover(r: dict) -> None:
    assert set(r["curves"]) == set(crossover.LAYOUTS) and positive(r["median_ttft_ms_poisson"].values())
    concurrency = [p["concurrency"] for p in r["curves"]["tp=4"]]
    assert concurrency == sorted(concurrency) and len(concurrency) >= 3
    for name, pts in r["curves"].items():
        assert [p["concurrency"] for p in pts] == concurrency, name
        assert positive(p["output_throughput"] for p in pts) and positive(p["tpot_ms"]["median"] for p in pts)
    tok = {k: {p["concurrency"]: p["output_throughput"] for p in v} for k, v in r["curves"].items()}
    assert r["dp_over_tp_throughput"] == {str(c): pytest.approx(tok["dp=4"][c] / tok["tp=4"][c])
                                          for c in concurrency}


def check_recipes(r: dict) -> None:
    assert set(r["curves"]) == set(recipes.LAYOUTS)
    concurrency = [p["concurrency"] for p in r["curves"]["tp=4"]["plain"]]
    assert concurrency == sorted(concurrency) and len(concurrency) >= 3
    for name, modes in r["curves"].items():
        assert set(modes) == ({"plain", "mtp", "mtp-off"} if name == "dp=4" else {"plain", "mtp"}), name
        for mode, pts in modes.items():
            assert [p["concurrency"] for p in pts] == concurrency, (name, mode)
            assert positive(p["output_throughput"] for p in pts), (name, mode)
        tok = {m: {p["concurrency"]: p["output_throughput"] for p in v} for m, v in modes.items()}
        assert r["mtp_speedup"][name] == {str(c): pytest.approx(tok["mtp"][c] / tok["plain"][c]) for c in concurrency}
        # the drafts were accepted: more than one token a verify on the default model's long skill
        assert 1.0 < r["avg_spec_accept_length"][name] <= 4.0, name
    # speculation off above the batch size measured in the run (MTP at least as fast up to it, or 1)
    tok = {m: {p["concurrency"]: p["output_throughput"] for p in v} for m, v in r["curves"]["dp=4"].items()}
    gained = [c for c in concurrency if tok["mtp"][c] >= tok["plain"][c]]
    assert r["disable_by_batch_size"] == max(gained, default=1)
    assert r["mtp_off_speedup"] == {str(c): pytest.approx(tok["mtp-off"][c] / tok["plain"][c]) for c in concurrency}


CHECKS = {"skew": check_skew, "single-request": check_single_request,
          "prompt-in-the-way": check_prompt_in_the_way, "ep": check_ep, "crossover": check_crossover,
          "recipes": check_recipes}
RECORDED = Path(__file__).parent.parent / "docs" / "experiments"  # tables and plots
RECORDED_JSON = Path(__file__).parent.parent / "benchmarks" / "results" / "experiments"  # their raw results


def check_outputs(name: str, out: Path, quick: bool = True, json_dir: Path | None = None) -> None:
    result = json.loads(((json_dir or out) / f"{name}.json").read_text())
    assert result["experiment"] == name and result["quick"] == quick
    CHECKS[name](result)
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / f"{name}.md").read_text()
    assert "| quantity | article" in table and table.count("\n|") >= 4 and "nan" not in table.lower()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_run_writes_results(name, tmp_path):
    assert main([name, "--quick", "--output-dir", str(tmp_path)]) == 0
    check_outputs(name, tmp_path)


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_the_recorded_full_runs_pass_the_same_checks(name):
    """docs/experiments/full/ holds one full run of each (docs/experiments.md quotes them)."""
    check_outputs(name, RECORDED / "full", quick=False, json_dir=RECORDED_JSON / "full")


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_the_recorded_runs_pass_the_same_checks(name):
    """docs/experiments/ holds one --quick run of each: the checks hold on it, and fail on a broken copy."""
    check_outputs(name, RECORDED, json_dir=RECORDED_JSON)
    broken = json.loads((RECORDED_JSON / f"{name}.json").read_text())
    {"skew": lambda r: r["steady"]["skewed"].update(requests_per_dp_rank={"0": 64}),
     "single-request": lambda r: r["median_itl_ms"].update({"dp=4": float("nan")}),
     "prompt-in-the-way": lambda r: r["tests"]["pinned long"].update(prompts_done=0),
     "ep": lambda r: r["expert_rows_per_step"]["moe=tp"]["skewed"].update(jaxdp_computed=160),
     "crossover": lambda r: r["curves"]["dp=4"][-1].update(output_throughput=0.0),
     "recipes": lambda r: r["avg_spec_accept_length"].update({"dp=4": 1.0})}[name](broken)
    with pytest.raises(AssertionError):
        CHECKS[name](broken)


def test_server_flags_for_the_delayer_and_mixed_chunks():
    from jaxdp.serve import UserError, build_parser, engine_config

    def config(*argv):
        return engine_config(build_parser().parse_args(list(argv)), 64)

    c = config("--enable-prefill-delayer", "--enable-mixed-chunk")
    assert c.enable_mixed_chunk and c.prefill_delayer.max_delay_passes == 30
    assert c.prefill_delayer.token_usage_low_watermark is None
    c = config("--enable-prefill-delayer", "--prefill-delayer-max-delay-passes", "5",
               "--prefill-delayer-token-usage-low-watermark", "0.2")
    assert (c.prefill_delayer.max_delay_passes, c.prefill_delayer.token_usage_low_watermark) == (5, 0.2)
    assert config().prefill_delayer is None and not config().enable_mixed_chunk
    with pytest.raises(UserError, match="need --enable-prefill-delayer"):
        config("--prefill-delayer-max-delay-passes", "5")
    with pytest.raises(ValueError, match=r"share of the KV pool in \[0, 1\], got 2.0"):
        config("--enable-prefill-delayer", "--prefill-delayer-token-usage-low-watermark", "2")
