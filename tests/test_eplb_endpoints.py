"""SGLang's expert-distribution endpoints over an engine (issue 47 point 2): start, requests, stop, dump; what the dump
counts against the tokens the engine computed; /metrics' balancedness; bad input refused in one sentence."""

from __future__ import annotations

import asyncio
import json

import httpx
import jax
import pytest

from jaxdp.api.app import create_app
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.serve import build_parser, serve_config
from jaxdp.serve_config import UserError

FLAG = {"expert_distribution_recorder_mode": "stat"}


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(page_size=4, num_pages=64, max_running_requests=8, chunked_prefill_size=32,
                       decode_buckets=[1, 4], extend_buckets=[16], max_len_extend_rows=16)
    with jax.default_matmul_precision("highest"):
        eng = Engine("tiny", "dp=2,moe=ep", cfg, seed=0, warmup=False)  # (compiles the shapes it meets)
        yield eng
        eng.shutdown()


def call(app, *requests: tuple[str, str]) -> list[httpx.Response]:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:30000") as http:
            return [await http.request(method, path) for method, path in requests]
    return asyncio.run(go())


def one_sentence(r: httpx.Response, status: int, starts: str) -> None:
    message = r.json()["error"]["message"]
    assert r.status_code == status and message.startswith(starts) and "\n" not in message, (r.status_code, message)


def test_a_recording_counts_every_token_the_engine_computed(engine, tmp_path, monkeypatch):
    app = create_app(engine, server_args=FLAG)
    (dump_early,) = call(app, ("POST", "/dump_expert_distribution_record"))
    one_sentence(dump_early, 400, "nothing was recorded; call /start_expert_distribution_record")
    started, = call(app, ("GET", "/start_expert_distribution_record"))
    assert started.status_code == 200 and started.text == "Start recording the expert distribution.\n"
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3 + 2 * i)] for i in range(6)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0))
    stopped, = call(app, ("POST", "/stop_expert_distribution_record"))
    assert stopped.text == "Stop recording the expert distribution.\n"
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0))  # after the stop: not counted
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    dump, metrics = call(app, ("POST", "/dump_expert_distribution_record"), ("GET", "/metrics"))
    body = dump.json()
    cfg = engine.model_cfg
    # each prompt token once, each generated token but the last fed back once: K choices in each MoE layer
    rows = sum(len(p) for p in prompts) + sum(len(r.output_ids) - 1 for r in out)
    per_layer = [sum(layer) for layer in body["logical_count"]]
    assert per_layer == [rows * cfg.num_experts_per_tok] * cfg.num_moe_layers
    assert len(body["per_device_logical_count"]) == 2 and body["num_steps"] > 0
    assert len(body["balancedness"]) == cfg.num_moe_layers and all(0 < b <= 1 for b in body["balancedness"])
    assert json.loads(open(body["path"]).read())["logical_count"] == body["logical_count"]
    text = metrics.text
    for layer, b in enumerate(body["balancedness"]):
        assert f'jaxdp:eplb_balancedness{{layer="{layer}",replica="0"}} {b}' in text


def test_endpoints_refused_in_one_sentence_without_the_flag(engine):
    app = create_app(engine, server_args={})
    for path in ("/start_expert_distribution_record", "/stop_expert_distribution_record",
                 "/dump_expert_distribution_record"):
        (r,) = call(app, ("POST", path))
        one_sentence(r, 400, "this server records no expert distribution; start it with "
                             "--expert-distribution-recorder-mode stat")
    (r,) = call(create_app(engine, server_args=FLAG), ("DELETE", "/start_expert_distribution_record"))
    one_sentence(r, 405, "DELETE is not allowed")


def test_an_unbuilt_recorder_mode_is_refused_before_anything_loads():
    args = build_parser().parse_args(["--model-path", "tiny", "--expert-distribution-recorder-mode", "per_token"])
    with pytest.raises(UserError, match=r"^--expert-distribution-recorder-mode 'per_token' is not built; use stat "
                                        r"\(or leave it out\)$"):
        serve_config(args)
    args = build_parser().parse_args(["--model-path", "tiny", "--expert-distribution-recorder-mode", "stat"])
    assert serve_config(args).flags["expert_distribution_recorder_mode"] == "stat"
