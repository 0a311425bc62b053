"""`python -m jaxdp.experiments`: bad command lines and a server that cannot start end in one `error:` line
(fast); each experiment's --quick run writes its JSON, PNG and markdown table (slow: minutes each)."""

import json

import pytest

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


KEYS = {"skew": "itl_ratio_skewed_over_balanced", "single-request": "itl_ratio_dp_over_tp",
        "prompt-in-the-way": "decode_tokens_lost_pct_with_delayer", "ep": "expert_rows_per_step",
        "crossover": "median_ttft_ms_poisson"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_quick_run_writes_results(name, tmp_path):
    assert main([name, "--quick", "--output-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["experiment"] == name and result["quick"] and KEYS[name] in result
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / f"{name}.md").read_text()
    assert "| quantity | article" in table and table.count("\n|") >= 4


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
