"""`python -m jaxdp.experiments`: bad command lines and a server that cannot start end in one `error:` line;
each experiment's code from its loads to its JSON, PNG and markdown table, run against stand-in servers (a
cost model in place of `jaxdp.serve`, so in seconds), passes the checks, and a broken copy does not; each
experiment's --quick run against real servers writes results that pass the same checks (slow: minutes each)."""

import contextlib
import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import jaxdp.disagg.router
from jaxdp.bench import serving as bench
from jaxdp.experiments import crossover, ep, prompt_in_the_way, recipes, single_request, skew
from jaxdp.experiments.__main__ import EXPERIMENTS, main
from jaxdp.experiments.runner import Context
from jaxdp.layout import parse_mesh_spec


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
BREAK = {"skew": lambda r: r["steady"]["skewed"].update(requests_per_dp_rank={"0": 64}),
         "single-request": lambda r: r["median_itl_ms"].update({"dp=4": float("nan")}),
         "prompt-in-the-way": lambda r: r["tests"]["pinned long"].update(prompts_done=0),
         "ep": lambda r: r["expert_rows_per_step"]["moe=tp"]["skewed"].update(jaxdp_computed=160),
         "crossover": lambda r: r["curves"]["dp=4"][-1].update(output_throughput=0.0),
         "recipes": lambda r: r["avg_spec_accept_length"].update({"dp=4": 1.0})}


def check_outputs(name: str, out: Path, quick: bool = True, json_dir: Path | None = None) -> dict:
    result = json.loads(((json_dir or out) / f"{name}.json").read_text())
    assert result["experiment"] == name and result["quick"] == quick
    CHECKS[name](result)
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / f"{name}.md").read_text()
    assert "| quantity | article" in table and table.count("\n|") >= 4 and "nan" not in table.lower()
    return result


@dataclasses.dataclass
class StandIn(Context):
    """A Context whose servers are a cost model: a decode step takes 5 ms plus 0.5 ms a row of the busiest rank
    (every rank runs the busiest rank's step), MTP verifies 2.5 tokens a step at a higher cost a row, a prompt
    takes the decoders' share of the cores in proportion to its length (less with the prefill delayer, little on
    a decode server apart). Requests go to their pinned rank or round robin, as the controller deals them; the
    points come from `jaxdp.bench.serving.summarize`, as a real run's do."""

    accept_length: float = 2.5
    started: dict[str, tuple[int, tuple[str, ...]]] = dataclasses.field(default_factory=dict)  # url: (dp, flags)

    @contextlib.contextmanager
    def server(self, mesh: str, *flags: str, label: str = "", tokenizer: bool = False) -> Iterator[str]:
        url = f"http://stand-in-{len(self.started)}"
        self.started[url] = (parse_mesh_spec(mesh).dp, (*flags, *self.server_flags))
        yield url

    def _gap_s(self, url: str, held: int, busiest: int) -> float:
        flags = self.started[url][1]
        spec = "--speculative-algorithm" in flags
        if spec and "--speculative-disable-by-batch-size" in flags:
            spec = held <= int(flags[flags.index("--speculative-disable-by-batch-size") + 1])
        return ((8 + 1.5 * busiest) / self.accept_length if spec else 5 + 0.5 * busiest) / 1000

    def _ranks(self, url: str, n: int, ranks: str) -> list[int]:
        dp = self.started[url][0]
        pinned = bench.rank_pattern(ranks, n)
        return [i % dp if r is None else r for i, r in enumerate(pinned)]

    def bench(self, url: str, *, num_prompts: int, input_len: int, output_len: int, concurrency: int | None = None,
              ranks: str = "none", rate: float | None = None, warmup: int = 1, seed: int = 1,
              dataset: Path | None = None) -> dict:
        placed = self._ranks(url, num_prompts, ranks)
        c = min(concurrency or num_prompts, num_prompts)
        busiest = max(Counter(placed[:c]).values())
        gap = self._gap_s(url, c, busiest)
        outs = []
        for r in placed:
            ttft = 1e-4 * input_len + gap
            outs.append(bench.Outcome(ok=True, prompt_tokens=input_len, output_tokens=output_len, ttft=ttft,
                                      e2e=ttft + (output_len - 1) * gap, itl=[gap] * (output_len - 1), dp_rank=r))
        duration = math.ceil(num_prompts / c) * outs[0].e2e
        return bench.summarize(outs, duration, concurrency, rate or math.inf)

    def steady_gap_ms(self, url: str, *, num_prompts: int, input_len: int, output_len: int, ranks: str) -> dict:
        placed = Counter(self._ranks(url, num_prompts, ranks))
        gap = self._gap_s(url, num_prompts, max(placed.values()))
        return {"gap_ms": 1000 * gap, "window_s": gap * (output_len - 2),
                "tokens_in_window": num_prompts * (output_len - 2),
                "requests_per_dp_rank": {str(r): c for r, c in placed.items()}}

    async def measure(self, url: str, load: prompt_in_the_way.Load, context: int) -> dict:
        """prompt_in_the_way's measurement of decoders while prompts arrive, from the cost model."""
        flags = self.started[url][1]
        busiest = max(Counter(self._ranks(url, len(load.decoder_ranks), "none")).values())
        step_s = self._gap_s(url, len(load.decoder_ranks), busiest)
        share = load.prompt_len / context * (0.5 if "--enable-prefill-delayer" in flags else 1.0)
        if "--disaggregation-mode" in flags:
            share *= 0.2
        rate_alone = len(load.decoder_ranks) / step_s
        rate_prompts = rate_alone * (1 - share)
        prompts_s = load.num_prompts * load.interval_steps * step_s
        series = [(round(k * step_s, 4), round(step_s * (1 + share * (k % 2)), 5)) for k in range(50)]
        return {"rate_alone": rate_alone, "rate_prompts": rate_prompts,
                "lost_pct": 100.0 * (1.0 - rate_prompts / rate_alone), "prompts_sent": load.num_prompts,
                "prompts_done": load.num_prompts, "prompt_ttft_s": load.prompt_len * 1e-3 + step_s,
                "median_itl_ms_alone": 1000 * step_s, "max_itl_ms_prompts": 1000 * step_s * (1 + share),
                "alone_s": load.alone_steps * step_s, "prompts_s": prompts_s, "decode_step_ms_alone": 1000 * step_s,
                "prompt_interval_s": load.interval_steps * step_s, "itl_series": series}


@contextlib.contextmanager
def stand_in_router(prefill: str, bootstrap: int, decode: str, log: Path) -> Iterator[str]:
    yield decode  # the router hands each request to the decode server once its prompt is read


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """Runs an experiment's own code against StandIn servers; returns (run(name, quick) -> output folder)."""
    def run(name: str, quick: bool, disaggregated: bool = False) -> Path:
        out = tmp_path / ("quick" if quick else "full")
        ctx = StandIn(name, quick, out, json_dir=out / "json")
        monkeypatch.setattr(prompt_in_the_way, "_measure", ctx.measure)
        monkeypatch.setattr(recipes, "server_accept_length", lambda url: ctx.accept_length)
        monkeypatch.setattr(jaxdp.disagg.router, "launch_router", stand_in_router)
        if disaggregated:
            prompt_in_the_way.run_disaggregated(ctx)
        else:
            EXPERIMENTS[name].run(ctx)
        return out
    return run


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_an_experiments_outputs_pass_the_checks_and_a_broken_copy_does_not(name, quick, stand_in):
    """The experiment's loads, summary, plot and table (what docs/experiments/ holds), computed against stand-in
    servers at its --quick and full sizes: the checks hold, and fail on a copy broken the way a bug would."""
    out = stand_in(name, quick)
    result = check_outputs(name, out, quick=quick, json_dir=out / "json")
    BREAK[name](result)
    with pytest.raises(AssertionError):
        CHECKS[name](result)


def test_the_stand_in_shows_what_the_experiments_measure(stand_in):
    """The checks are not vacuous on the stand-in: it reproduces the article's direction where its cost model
    says so (a skewed load costs more than a balanced one; EP's expert rows are the needed ones)."""
    r = json.loads((stand_in("skew", True) / "json" / "skew.json").read_text())
    assert r["itl_ratio_one_rank_over_balanced"] > r["itl_ratio_skewed_over_balanced"] > 1.0
    r = json.loads((stand_in("prompt-in-the-way", True) / "json" / "prompt-in-the-way.json").read_text())
    assert r["decode_tokens_lost_pct"]["long"] > r["decode_tokens_lost_pct"]["short"] > 0
    assert r["decode_tokens_lost_pct_with_delayer"] < r["decode_tokens_lost_pct_unpinned"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_run_writes_results(name, tmp_path):
    assert main([name, "--quick", "--output-dir", str(tmp_path)]) == 0
    check_outputs(name, tmp_path)


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
