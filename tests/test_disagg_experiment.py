"""`python -m jaxdp.experiments prompt-in-the-way --disaggregated` (issue 30): the decoders' tokens lost to long
prompts on one colocated server, with the prefill delayer, and with prefill and decode on separate servers behind
SGLang's router; the prompts' TTFT each way. Bad command lines are one error line (fast); the experiment's code from
its loads to its outputs, run against stand-in servers and router (tests/test_experiments.py's cost model), passes the
checks and a broken copy does not (fast); a --quick run writes its JSON, PNG and table (slow)."""

import json
import math
from pathlib import Path

import pytest
from test_experiments import stand_in  # noqa: F401  (the fixture)

from jaxdp.disagg.router import router_python
from jaxdp.experiments.__main__ import main

NAME = "prompt-in-the-way-disaggregated"
TESTS = ("colocated", "colocated, delayer", "disaggregated")


@pytest.mark.parametrize("argv, says", [
    (["skew", "--disaggregated"], "--disaggregated is an option of prompt-in-the-way only"),
    (["prompt-in-the-way", "--disaggregated", "--disaggregation-timeout", "5"],
     "--disaggregation-* flags are chosen by the experiment itself"),
])
def test_bad_command_lines_are_one_error_line(argv, says, capsys, tmp_path):
    assert main([*argv, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("*.json"))


def check(r: dict) -> None:
    assert r["experiment"] == NAME and set(r["tests"]) == set(TESTS) == set(r["itl_series"])
    for name, t in r["tests"].items():
        assert t["prompts_sent"] > 0 and t["prompts_done"] == t["prompts_sent"], name  # every prompt was read
        for key in ("rate_alone", "prompt_ttft_s", "decode_step_ms_alone", "prompts_s"):
            assert math.isfinite(t[key]) and t[key] > 0, (name, key)
        assert t["lost_pct"] == pytest.approx(100 * (1 - t["rate_prompts"] / t["rate_alone"])), name
        assert r["itl_series"][name] and all(gap >= 0 for _, gap in r["itl_series"][name]), name
    assert r["decode_tokens_lost_pct"] == {k: t["lost_pct"] for k, t in r["tests"].items()}
    assert r["prompt_ttft_s"] == {k: t["prompt_ttft_s"] for k, t in r["tests"].items()}


def check_outputs(out: Path, quick: bool, json_dir: Path | None = None) -> None:
    result = json.loads(((json_dir or out) / f"{NAME}.json").read_text())
    assert result["quick"] == quick
    check(result)
    assert (out / f"{NAME}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / f"{NAME}.md").read_text()
    assert "| quantity | article" in table and table.count("\n|") >= 4 and "nan" not in table.lower()


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_the_outputs_pass_the_checks_and_a_broken_copy_does_not(quick, stand_in):  # noqa: F811
    """The three servers' measurements summarized, plotted and tabled (what docs/experiments/ holds): the checks
    hold, the decode server apart loses fewer tokens than the colocated one in the stand-in's cost model, and a
    prompt whose KV never came fails the checks."""
    out = stand_in(NAME, quick, disaggregated=True)
    check_outputs(out, quick=quick, json_dir=out / "json")
    result = json.loads((out / "json" / f"{NAME}.json").read_text())
    lost = result["decode_tokens_lost_pct"]
    assert lost["disaggregated"] < lost["colocated, delayer"] < lost["colocated"]
    result["tests"]["disaggregated"]["prompts_done"] = 0  # a prompt whose KV never came
    with pytest.raises(AssertionError):
        check(result)


@pytest.mark.slow
@pytest.mark.skipif(router_python() is None, reason="needs sglang-router (tests/test_disagg_router.py installs it)")
def test_quick_run_writes_results(tmp_path):
    assert main(["prompt-in-the-way", "--disaggregated", "--quick", "--output-dir", str(tmp_path)]) == 0
    check_outputs(tmp_path, quick=True)
