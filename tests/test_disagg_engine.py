"""Prefill/decode disaggregation between two engines (issue 30): a prefill engine (dp=2) reads every prompt and
hands its KV over; a decode engine (dp=2, another page size) never runs a prompt step for those requests and
gives the greedy tokens of one colocated engine; every page comes back on both sides; a refused or lost
hand-off ends the request in one sentence with its pages freed; bootstrap fields where they do not belong are
refused in one sentence."""

from __future__ import annotations

import random

import jax
import pytest

from jaxdp.bench.launch import free_port
from jaxdp.engine import Engine
from jaxdp.engine.options import DisaggConfig, EngineConfig, ModelOptions
from jaxdp.engine.request import BadRequest, Bootstrap, SamplingParams
from jaxdp.engine.setup import build_runners
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import default_model_path

pytestmark = pytest.mark.skipif(not (default_model_path() / "tokenizer.json").exists(),
                                reason="needs the default model")

PROMPTS = ["37+48=", "91-17=", "sort 3142=", "reverse abcde=", "count a abcab=", "6*7=", "123*4=",
           "12+34=" * 12]  # (the last: 72 tokens, several pages on both sides)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def _engine(devices, page_size, disagg=None, max_running=8):
    layout = parse_mesh_spec("dp=2")
    runner = build_runners(ModelOptions(dtype="float32"), layout, [layout.make_mesh(devices)], num_pages=64,
                           page_size=page_size)[0]
    cfg = EngineConfig(max_running_requests=max_running, chunked_prefill_size=64, disaggregation=disagg)
    from jaxdp.tokenizer import Tokenizer

    return Engine(runner, "dp=2", cfg, tokenizer=Tokenizer(default_model_path()))


@pytest.fixture(scope="module")
def engines():
    port = free_port()
    devs = jax.devices()
    prefill = _engine(devs[0:2], 16, DisaggConfig("prefill", bootstrap_port=port, model="default", timeout_s=30))
    decode = _engine(devs[2:4], 8, DisaggConfig("decode", model="default", timeout_s=30))
    together = _engine(devs[4:6], 16)
    for e in (prefill, decode):
        e.start()
    yield prefill, decode, together, port
    for e in (prefill, decode, together):
        e.shutdown()


def _wait(reqs, timeout=120):
    import time

    deadline = time.monotonic() + timeout
    while not all(r.finished for r in reqs):
        assert time.monotonic() < deadline, [r.rid for r in reqs if not r.finished]
        time.sleep(0.02)


def _pages_back(engine):
    for s in engine.schedulers:
        assert s.pool.free + s.cache.evictable() == s.pool.num_pages, (s.rank, s.pool.free)
        assert not s.kv_waiting and not s.running and not s.waiting


def test_decode_server_gives_the_colocated_greedy_tokens(engines):
    prefill, decode, together, port = engines
    want = [r.output_ids for r in together.generate([together.tokenizer.encode(p) for p in PROMPTS], GREEDY)]
    rng = random.Random(0)
    rooms = [rng.getrandbits(63) for _ in PROMPTS]
    dec = [decode.submit(decode.make_request(p, GREEDY, bootstrap=Bootstrap("127.0.0.1", port, room)))
           for p, room in zip(PROMPTS, rooms, strict=True)]
    pre = [prefill.submit(prefill.make_request(p, GREEDY, bootstrap=Bootstrap("127.0.0.1", port, room)))
           for p, room in zip(PROMPTS, rooms, strict=True)]
    _wait(pre + dec)
    assert [r.output_ids for r in dec] == want
    assert all(len(r.output_ids) == 1 and r.finish_reason == "length" for r in pre)
    assert [r.rank for r in pre] == [room % 2 for room in rooms]  # the prefill rank from the room, as SGLang
    assert all(r.output_ids[0] == w[0] for r, w in zip(pre, want, strict=True))
    kinds = {r.kind for r in decode.stats.records}
    assert kinds == {"decode"}, kinds  # the decode server never ran a prompt step
    assert "extend" in {r.kind for r in prefill.stats.records}
    assert prefill.stats.compiles_in_steps == decode.stats.compiles_in_steps == 0  # all compiled at start-up
    assert decode.disagg.transferred_bytes > 0
    _pages_back(prefill)
    _pages_back(decode)


def test_a_refused_or_lost_hand_off_ends_the_request_in_one_sentence(engines):
    prefill, decode, _, port = engines
    # the prefill side refuses the room (its engine refused or lost the prompt)
    room = 77
    req = decode.submit(decode.make_request("5+5=", GREEDY, bootstrap=Bootstrap("127.0.0.1", port, room)))
    prefill.disagg.side.refuse(room, "the prompt has 1600 tokens but a rank holds at most 1024; shorten it")
    _wait([req])
    assert req.finish_reason == "abort" and "shorten it" in req.error
    # nobody at that bootstrap port
    req = decode.submit(decode.make_request("1+1=", GREEDY, bootstrap=Bootstrap("127.0.0.1", free_port(), 5)))
    _wait([req])
    assert req.finish_reason == "abort" and "no prefill server answers at bootstrap" in req.error
    assert "\n" not in req.error
    _pages_back(decode)


def test_bootstrap_fields_where_they_do_not_belong(engines):
    prefill, decode, together, port = engines
    with pytest.raises(BadRequest, match="does not run --disaggregation-mode"):
        together.make_request("1+1=", GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 1))
    for e in (prefill, decode):
        with pytest.raises(BadRequest, match="send requests through SGLang's router"):
            e.make_request("1+1=", GREEDY)
