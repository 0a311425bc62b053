"""The benchmarks' floor: the planner's roofline priced with this machine's measured figures, cached once."""

import json

from jaxdp.bench.peer_model import PEER_CONFIG
from jaxdp.planner import measured
from jaxdp.planner.roofline import expected_experts
from jaxdp.planner.weights import weights_per_device


def _machine():
    return measured.Machine(40e9, 400e9, 600e9, "test", 0.0)


def test_floor_reads_the_chosen_experts_and_the_cache():
    cfg = PEER_CONFIG
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # bf16 bytes of one routed expert
    from jaxdp.layout import Layout

    rest = sum(c.bytes_per_device for c in weights_per_device(cfg, Layout(), placement="jaxdp")
               if c.read_per_step and c.name != "embedding")  # a step reads its rows of the embedding only
    kv = cfg.num_layers * cfg.kv_cache_dim * 2  # bf16 bytes of one cached token, every layer
    for rows in (1, 8, 32):
        roof = measured.step_floor(cfg, [1] * rows, 64, "bfloat16", _machine())
        experts = expected_experts(rows, cfg.n_routed_experts, cfg.num_experts_per_tok) * expert * cfg.num_moe_layers
        want = rest + experts + rows * 65 * kv
        assert abs(sum(t.hbm_bytes for t in roof.terms) - want) < 1e-6 * want
    one = sum(t.hbm_bytes for t in measured.step_floor(cfg, [1], 64, "bfloat16", _machine()).terms)
    assert 130 * 2**20 < one < 140 * 2**20  # issue 26: 136 MiB at batch 1 in bf16
    held32 = sum(t.hbm_bytes for t in measured.step_floor(cfg, [1], 64, "float32", _machine()).terms)
    assert 1.95 * one < held32 < 2.0 * one  # float32-held weights: twice the bytes (the router is float32 in both)


def test_machine_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDP_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(measured, "measure", lambda: calls.append(1) or _machine())
    monkeypatch.setattr(measured, "_machine_key", lambda: "test")
    first = measured.machine()
    assert measured.machine() == first and len(calls) == 1
    assert json.loads((tmp_path / "machine.json").read_text())["read_GBps"] == 40.0
    measured.machine(refresh=True)
    assert len(calls) == 2
