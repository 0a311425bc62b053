"""Prefill/decode disaggregation between two engines (issue 30): a prefill engine (dp=2) reads every prompt and
hands its KV over; a decode engine (dp=2, another page size) never runs a prompt step for those requests and
gives the greedy tokens of one colocated engine; every page comes back on both sides; a refused or lost
hand-off ends the request in one sentence with its pages freed; bootstrap fields where they do not belong are
refused in one sentence."""

from __future__ import annotations

import json
import random
import re

import jax
import jsonschema
import pytest

from jaxdp.engine import Engine
from jaxdp.engine.options import DisaggConfig, EngineConfig, ModelOptions
from jaxdp.engine.sched.request import BadRequest, Bootstrap, GrammarSpec, SamplingParams
from jaxdp.engine.setup import build_runners
from jaxdp.grammar import Grammars, vocabulary
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import default_model_path
from jaxdp.net import free_port

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

    tokenizer = Tokenizer(default_model_path())
    grammars = Grammars.create("llguidance", vocabulary(tokenizer, runner.cfg.vocab_size))
    return Engine(runner, "dp=2", cfg, tokenizer=tokenizer, grammars=grammars)


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
    # the hand-off's figures per rank (what /metrics shows under SGLang's names)
    got = [s.state()["disagg"] for s in decode.schedulers]
    assert sum(d["transfers"] for d in got) == len(PROMPTS)
    assert sum(d["bytes"] for d in got) == decode.disagg.transferred_bytes
    assert all(d["prealloc"] == d["transfer"] == 0 and d["transfer_failed"] == 0 for d in got)
    for key in ("latency_ms", "speed_gbs", "total_mb", "bootstrap_ms"):
        assert sum(sum(d[key]["counts"]) for d in got) == len(PROMPTS) and all(d[key]["sum"] >= 0 for d in got)
    sent = [s.state()["disagg"] for s in prefill.schedulers]
    assert [d["transfers"] for d in sent] == [sum(r.rank == k for r in pre) for k in range(2)]
    assert sum(d["bytes"] for d in sent) == decode.disagg.transferred_bytes
    assert all(d["inflight"] == 0 and d["dropped"] == 0 for d in sent)  # every offer taken
    assert "disagg" not in together.schedulers[0].state()


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
    failed = sum(s.state()["disagg"]["bootstrap_failed"] for s in decode.schedulers)
    assert failed == 2 and sum(s.state()["disagg"]["transfer_failed"] for s in decode.schedulers) == 0


def test_an_offer_no_decode_server_takes_is_in_flight_then_dropped(engines):
    """A decode server that disappears: the prefill side's offer counts in flight, then is dropped after the
    timeout (the board's keep_s, here shortened), and the prefill rank's pages are back at once."""
    prefill, _, _, port = engines
    board = prefill.disagg.side.board
    keep, board.keep_s = board.keep_s, 1.0
    try:
        req = prefill.submit(prefill.make_request("7+8=", GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 4)))
        _wait([req])
        _pages_back(prefill)
        assert prefill.schedulers[0].state()["disagg"]["inflight"] == 1
        import time
        time.sleep(1.2)
        d = prefill.schedulers[0].state()["disagg"]
        assert d["inflight"] == 0 and d["dropped"] == 1
    finally:
        board.keep_s = keep


def test_bootstrap_fields_where_they_do_not_belong(engines):
    prefill, decode, together, port = engines
    with pytest.raises(BadRequest, match="does not run --disaggregation-mode"):
        together.make_request("1+1=", GREEDY, bootstrap=Bootstrap("127.0.0.1", port, 1))
    for e in (prefill, decode):
        with pytest.raises(BadRequest, match="send requests through SGLang's router"):
            e.make_request("1+1=", GREEDY)


def test_metrics_show_the_hand_off_under_sglang_names(engines):
    """/metrics of each server (ServerMetrics over the engine, as the app builds it): SGLang's disaggregation
    queues, transfer histograms and failure counters, under `sglang:` and `jaxdp:`."""
    from jaxdp.api.metrics import ServerMetrics
    from jaxdp.api.replicas import ReplicaSet

    prefill, decode, together, _ = engines
    text = ServerMetrics(ReplicaSet([decode]), "default").render().decode()
    for name in ("num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs", "kv_transfer_speed_gb_s_bucket",
                 "kv_transfer_latency_ms_count", "kv_transfer_total_mb_sum", "kv_transfer_bootstrap_ms_count",
                 "num_bootstrap_failed_reqs_total", "num_transfer_failed_reqs_total", "kv_transfer_bytes_total"):
        assert f"sglang:{name}{{" in text and f"jaxdp:{name}{{" in text, name
    count = sum(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("sglang:kv_transfer_latency_ms_count"))
    assert count == sum(s.state()["disagg"]["transfers"] for s in decode.schedulers) > 0
    text = ServerMetrics(ReplicaSet([prefill]), "default").render().decode()
    assert 'sglang:num_prefill_inflight_queue_reqs{dp_rank="0",model_name="default"}' in text
    assert "jaxdp:kv_transfer_bytes_total" in text
    text = ServerMetrics(ReplicaSet([together]), "default").render().decode()
    assert "kv_transfer" not in text and "prealloc_queue" not in text  # (a server in no disaggregation mode)


def test_a_request_its_first_token_ends_leaves_the_rows_as_they_were(engines):
    """The prefill server's first token can end a request (EOS, a stop token): the decode side finishes it
    without giving it a row, and the requests decoding beside it go on (this lost a running request before)."""
    prefill, decode, together, port = engines
    first = together.generate([together.tokenizer.encode(PROMPTS[0])], GREEDY)[0].output_ids[0]
    ends = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[first])
    rng = random.Random(1)
    rooms = [rng.getrandbits(63) for _ in range(6)]
    params = [ends] * 3 + [GREEDY] * 3
    prompts = [PROMPTS[0]] * 3 + PROMPTS[1:4]
    dec = [decode.submit(decode.make_request(p, sp, bootstrap=Bootstrap("127.0.0.1", port, room)))
           for p, sp, room in zip(prompts, params, rooms, strict=True)]
    pre = [prefill.submit(prefill.make_request(p, GREEDY, bootstrap=Bootstrap("127.0.0.1", port, room)))
           for p, room in zip(prompts, rooms, strict=True)]
    _wait(pre + dec)
    assert [r.output_ids for r in dec[:3]] == [[first]] * 3 and all(r.finish_reason == "stop" for r in dec[:3])
    want = [r.output_ids for r in together.generate([together.tokenizer.encode(p) for p in PROMPTS[1:4]], GREEDY)]
    assert [r.output_ids for r in dec[3:]] == want
    for s in decode.schedulers:
        assert sorted(s.rows._free) == list(range(len(s.rows.reqs))), "a row was lost or freed twice"
    _pages_back(decode)
    _pages_back(prefill)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
PATTERN = r"\d{1,3}-[a-z]{2,5}"


def test_penalties_and_grammars_through_the_hand_off_give_the_colocated_tokens(engines):
    """Issue 46 under disaggregation: the prefill server samples the first token with the request's penalties
    (repetition over the prompt), logit bias and grammar; the decode server fills the penalty slot from the
    prompt and that token and starts the grammar's matcher past it, so the greedy tokens are one colocated
    engine's (which differ from the same prompts' without the controls: the test sees them applied)."""
    prefill, decode, together, port = engines
    g = dict(max_new_tokens=12, temperature=0.0, ignore_eos=True)  # (long enough for the penalties to bite)
    person = GrammarSpec("json_schema", json.dumps(PERSON))
    cases = [(PROMPTS[7], SamplingParams(**g, repetition_penalty=1.8)),
             (PROMPTS[7], SamplingParams(**g, frequency_penalty=1.5, presence_penalty=0.5)),
             (PROMPTS[3], SamplingParams(**g, repetition_penalty=1.5)),
             (PROMPTS[2], SamplingParams(**g, repetition_penalty=1.3, frequency_penalty=0.8, logit_bias={30: 2.0})),
             (PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0.0, grammar=GrammarSpec("regex", PATTERN))),
             (PROMPTS[4], SamplingParams(max_new_tokens=40, temperature=0.0, grammar=person)),
             (PROMPTS[1], SamplingParams(max_new_tokens=40, temperature=0.0, grammar=person, repetition_penalty=1.2)),
             (PROMPTS[5], SamplingParams(max_new_tokens=8, temperature=0.0))]
    prompts = [together.tokenizer.encode(p) for p, _ in cases]
    want = [r.output_ids for r in together.generate(prompts, [sp for _, sp in cases])]
    plain = [r.output_ids for r in together.generate(prompts[:7], SamplingParams(**g))]
    assert all(w != p[: len(w)] for w, p in zip(want, plain, strict=False)), "the controls changed nothing"
    rng = random.Random(2)
    rooms = [rng.getrandbits(63) for _ in cases]
    dec = [decode.submit(decode.make_request(p, sp, bootstrap=Bootstrap("127.0.0.1", port, room)))
           for (p, sp), room in zip(cases, rooms, strict=True)]
    pre = [prefill.submit(prefill.make_request(p, sp, bootstrap=Bootstrap("127.0.0.1", port, room)))
           for (p, sp), room in zip(cases, rooms, strict=True)]
    _wait(pre + dec)
    assert [r.error for r in dec] == [None] * len(cases)
    assert [r.output_ids for r in dec] == want
    assert [r.output_ids[0] for r in pre] == [w[0] for w in want]
    text = [decode.tokenizer.decode(r.output_ids) for r in dec]
    assert re.fullmatch(PATTERN, text[4]) and dec[4].finish_reason == "stop", text[4]
    for t, r in zip(text[5:7], dec[5:7], strict=True):
        assert r.finish_reason == "stop", t
        jsonschema.validate(json.loads(t), PERSON)
    for e in (prefill, decode):
        _pages_back(e)
        assert all(s.constrained == 0 and s.controlled == 0 and not s.joined_to_fill for s in e.schedulers)
        assert all(sorted(s.free_slots) == list(range(s.cfg.penalty_slots)) for s in e.schedulers)
    assert decode.stats.compiles_in_steps == 0 and {r.kind for r in decode.stats.records} == {"decode"}
