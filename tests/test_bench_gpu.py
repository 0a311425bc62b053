"""`python -m jaxdp.bench.gpu`'s CPU rehearsal: the GPU session's code path end to end at tiny shapes in interpret
mode, its deadline honoured (stages cut, the output written all the same), and the winners it writes in the shape
`jaxdp.ops.registry.choose` reads."""

import json
import math
import time

import jax
import jax.numpy as jnp

from jaxdp.bench import gpu
from jaxdp.bench.gpu_sweep import KERNELS, tile_candidates
from jaxdp.bench.gpu_trace import hlo_costs
from jaxdp.ops import registry


def test_the_rehearsal_traces_sweeps_and_writes_winners_choose_reads(tmp_path, monkeypatch):
    committed = registry.WINNERS.read_text()
    deadline = 180  # (the trace's share: its first shape on two busy cores)
    t0 = time.monotonic()
    assert gpu.main(["--deadline-s", str(deadline), "--out", str(tmp_path), "--stages", "trace,sweep",
                     "--ops", "mla_decode"]) == 0
    assert time.monotonic() - t0 < deadline + 15
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["rehearsal"] and "--out" not in report["command"] and str(tmp_path) not in json.dumps(report)
    assert [s["stage"] for s in report["stages"]] == ["trace", "sweep"]
    if report["trace"]:  # its first shape within its share of the deadline (on two busy cores it may be cut)
        trace = report["trace"][0]
        assert trace["step_ms"] > 0 and trace["floor_ms"] > 0 and trace["x_floor"] > 0 and trace["kernels"]
        assert any(k["flops"] > 0 for k in trace["kernels"]) and all(k["bytes"] >= 0 for k in trace["kernels"])
        assert {p["part"] for p in trace["parts"]} >= {"mla_attention", "routed_experts", "lm_head"}
        assert "x the floor" in (tmp_path / "gpu.md").read_text()
    else:
        assert report["stages"][0]["status"] == "cut at the deadline"
    rows = [r for r in report["sweep"] if r["kind"] == "backend"]
    assert {r["candidate"] for r in rows} >= {"xla", "pallas"} and all(r["op"] == "mla_decode" for r in rows)
    assert all(r["error"] is None and r["max_abs_diff"] < 2e-2 for r in rows if r["candidate"] != "xla")
    md = (tmp_path / "gpu.md").read_text()
    assert "REHEARSAL" in md and "| mla_decode |" in md
    assert registry.WINNERS.read_text() == committed  # a rehearsal leaves the committed table alone
    table = json.loads((tmp_path / "winners.json").read_text())
    kind = jax.devices()[0].device_kind
    winner = report["winners"]["mla_decode"]["candidate"]
    assert table[kind]["mla_decode"] == winner
    monkeypatch.setattr(registry, "_winners_file", lambda: table)
    assert registry.choose("mla_decode", None, "cpu", kind) == winner


def test_a_deadline_too_short_for_a_stage_skips_it_and_still_writes(tmp_path):
    assert gpu.main(["--deadline-s", "12", "--out", str(tmp_path), "--stages", "trace,sweep"]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [s["status"] for s in report["stages"]] == ["skipped: no time left"] * 2
    assert report["trace"] == [] and report["winners"] == {} and (tmp_path / "gpu.md").exists()


def test_a_stage_cut_at_the_deadline_keeps_what_it_measured(tmp_path):
    """The sweep is killed mid-way (its first rows written already); the run still writes them and their winner."""
    assert gpu.main(["--deadline-s", "40", "--out", str(tmp_path), "--stages", "sweep", "--ops", "projection_gemm",
                     "--rehearse"]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["stages"][0]["seconds"] < 40
    measured = {r["candidate"] for r in report["sweep"] if r["kind"] == "backend"}
    if len(measured) > 1:  # (on a loaded machine even the first case may not finish)
        assert report["winners"]["projection_gemm"]["candidate"] in measured


def test_an_unknown_stage_is_refused_in_one_sentence(capsys):
    assert gpu.main(["--stages", "trace,bench"]) == 2
    assert capsys.readouterr().err.strip() == "error: --stages names bench; choose from tests, trace, sweep"


def _row(op, case, candidate, us, base_us, diff=1e-3, kind="backend", error=None):
    return dict(event="sweep", op=op, kernel=op, case=case, kind=kind, candidate=candidate, tiles=None, us=us,
                base_us=base_us, max_abs_diff=math.nan if candidate == "xla" else diff, base_max_abs=1.0, error=error)


def test_the_winner_is_the_fastest_correct_backend_over_every_shape(tmp_path):
    rows = [_row("mla_decode", "a", "xla", 100, 100), _row("mla_decode", "a", "pallas", 20, 100),
            _row("mla_decode", "b", "xla", 100, 100), _row("mla_decode", "b", "pallas", 40, 100),
            _row("mla_decode", "a", "native", 1, 100, diff=5.0),  # fast and wrong
            _row("expert_gemm", "a", "xla", 100, 100), _row("expert_gemm", "a", "pallas", math.nan, 100, error="X"),
            _row("projection_gemm", "a", "xla", 100, 100)]  # nothing to choose between
    winners = gpu.pick_winners(rows, "backend", "op")
    assert winners["mla_decode"]["candidate"] == "pallas"
    assert math.isclose(winners["mla_decode"]["time_over_baseline"], math.sqrt(0.2 * 0.4))
    assert "expert_gemm" not in winners and "projection_gemm" not in winners
    path = tmp_path / "winners.json"
    path.write_text(json.dumps({"NVIDIA H200": {"expert_gemm": "blocked", "mla_decode": "xla"},
                                "NVIDIA H100 80GB HBM3": {"mla_decode": "xla"}}))
    merged = gpu.merge_winners(path, "NVIDIA H200", winners)
    assert merged == {"NVIDIA H200": {"expert_gemm": "blocked", "mla_decode": "pallas"},
                      "NVIDIA H100 80GB HBM3": {"mla_decode": "xla"}}


def test_tile_candidates_start_from_the_defaults_and_the_last_winner():
    kernel = KERNELS["mla_decode"]
    tiles = tile_candidates(kernel, {"block_h": 32, "num_splits": 4})
    assert tiles[0] == kernel.defaults and tiles[1] == {**kernel.defaults, "block_h": 32, "num_splits": 4}
    assert len({tuple(sorted(t.items())) for t in tiles}) == len(tiles)


def test_hlo_costs_count_dots_and_what_a_slice_reads():
    def f(x, stack, layer):
        return jnp.tanh(x @ jax.lax.dynamic_index_in_dim(stack, layer, keepdims=False))

    x, stack = jnp.ones((4, 256), jnp.float32), jnp.ones((64, 256, 512), jnp.float32)
    costs = hlo_costs(jax.jit(f).lower(x, stack, 3).compile().as_text())
    assert max(c["flops"] for c in costs.values()) == 2 * 4 * 256 * 512
    assert max(c["bytes"] for c in costs.values()) < stack.nbytes / 8  # one layer of the stack, not all 64
