"""`python -m jaxdp.bench.constrained --served` (docs/api.md, issue 46's cost goal): the engine with the default model
and the llguidance backend, the same prompts without and with one JSON schema, at equal output lengths."""

import json

import pytest

from jaxdp.bench import constrained


def test_the_served_load_compares_equal_output_lengths_and_times_the_schemas_compile(tmp_path, capsys):
    out = tmp_path / "served.json"
    argv = ["--served", "--mesh", "dp=2", "--concurrency", "4", "--input-len", "8", "--output-len", "12",
            "--rounds", "1", "--json", str(out)]
    assert constrained.main(argv) == 0
    r = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert (r["mesh"], r["model"], r["backend"]) == ("dp=2", "default", "llguidance")
    assert [x["constrained"] for x in r["rounds"]] == [False, True]  # (after the warm-up pair)
    for x in r["rounds"]:
        assert x["output_tokens"] == 4 * 12 and x["tokens_per_s"] > 0 and x["decode_steps"] > 0
        assert x["cpu_us_per_token"]["main"] > 0
    assert len(r["ratios"]) == 1 and r["ratio_median"] == pytest.approx(
        r["rounds"][1]["tokens_per_s"] / r["rounds"][0]["tokens_per_s"])
    assert r["compile"]["uncached_ms"] > r["compile"]["cached_ms"] > 0
    assert "constrained / unconstrained output tok/s: median" in printed


def test_a_schema_shorter_than_the_output_length_is_refused_as_unequal(tmp_path, monkeypatch):
    """The comparison holds only while every constrained answer runs to --output-len: a schema whose answers end
    first (the grammar's end ends the request) stops the benchmark with the lengths it saw."""
    monkeypatch.setattr(constrained, "LONG_SCHEMA", {"type": "object", "properties": {"a": {"type": "boolean"}},
                                                     "required": ["a"]})
    argv = ["--served", "--mesh", "dp=2", "--concurrency", "2", "--input-len", "8", "--output-len", "24",
            "--rounds", "1", "--json", str(tmp_path / "x.json")]
    with pytest.raises(RuntimeError, match="unequal output lengths"):
        constrained.main(argv)
