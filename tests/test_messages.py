"""The messages on jaxdp's sockets (`jaxdp.engine.ipc.messages`): no module pickles, every message type survives the
codec whole, and a frame that is not the expected message is refused in one sentence, by the codec and by both
ends of the engine process's sockets (no hang, nothing guessed)."""

from __future__ import annotations

import inspect
import os
import re
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from jaxdp.engine.ipc import messages as m
from jaxdp.engine.ipc.updates import PromptLogprobs, SentRequest, Update
from jaxdp.engine.options import EngineConfig
from jaxdp.engine.sched.delayer import DelayerConfig
from jaxdp.engine.sched.request import SamplingParams
from jaxdp.engine.sched.scheduler import SchedulerConfig
from jaxdp.engine.step.buckets import Buckets
from jaxdp.engine.step.step_stats import StepRecord
from jaxdp.parallel.agreement import Proposal

ROOT = Path(__file__).resolve().parents[1]
PICKLING = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|marshal)\b"
                      r"|\b(c?pickle|dill|marshal)\.(loads?|dumps?|Unpickler|Pickler)\b|\b(send|recv)_pyobj\b", re.M)


def test_no_module_sends_or_receives_pickle():
    offenders = [f"{p.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}"
                 for d in ("jaxdp", "kernels_pallas") for p in sorted((ROOT / d).rglob("*.py"))
                 for text in [p.read_text()] for match in PICKLING.finditer(text)]
    assert offenders == []
    assert PICKLING.search("import pickle\n") and PICKLING.search("sock.send_pyobj(x)")  # the pattern finds them


def facts() -> m.EngineFacts:
    from jaxdp.config import get_config
    from jaxdp.layout import parse_mesh_spec

    cfg = EngineConfig(page_size=4, num_pages=64, decode_buckets=[1, 2], prefill_delayer=DelayerConfig(7, 0.25))
    return m.EngineFacts(parse_mesh_spec("dp=2,tp=2"), cfg, Buckets.make(4, 16, 2).with_pages(8, 4),
                         get_config("tiny"), 32, range(2, 4), SchedulerConfig(8, 4, 32, 0.3, (1, 2), 100, 5), 64, 4,
                         3, {2: {"num_reqs": 0, "token_usage": 0.0}, 3: {"num_reqs": 0, "token_usage": 0.0}})


def one_of_each() -> list:
    params = SamplingParams(max_new_tokens=5, temperature=0.5, seed=3, stop=["x"], top_logprobs=2,
                            token_ids_logprob=[4, 5])
    sent = SentRequest("r1", [1, 2, 3], params, 1)
    pairs = [(5, -0.25), (6, -1.5)]
    update = Update("r1", [7, 8], [-0.5, -0.75], [pairs, pairs], 2, "stop", "an error", 503, [pairs, pairs],
                    PromptLogprobs([None, -1.0], [None, pairs], [None, pairs]))
    record = StepRecord("decode", [1, 2], 2, "max_len", 0, 1.0, 1.5, 0.001, 0.002, 0.003, 3, 0.0005)
    flush = m.NodeFlush(1, range(4, 8), True, 16, None, {4: {"num_reqs": 0}})
    node = m.NodeMessage(new=[sent], abort=["r2"], flush=[3], stop=True, updates=[update], flushed=[(3, flush)],
                         states={4: {"num_reqs": 1, "token_usage": 0.5}}, prefill_delayer=[(True, False)],
                         rooms=[m.RoomOutcome(9, "ready", 5, 21, 42, -0.5, "127.0.0.1:4000", {"addr": 1, "md": "x"}),
                                m.RoomOutcome(10, "failed", error="refused")])
    return [m.Submit(0, sent), m.Abort(1, "r1"), m.Ask(4, 0, "rank_states"), m.Ask(5, 1, "flush_cache"), m.Shutdown(),
            m.Ready([facts()]), m.StepDone(0, [update], [record], 9, 1, None, m.Counters(12, 3, {"delay": 2})),
            m.States(4, {0: {"num_reqs": 2}}), m.Flushed(5, [flush]), m.Flushed(6, None), m.CallFailed(7, "boom"),
            m.Ask(8, 0, "expert_record_dump"), m.ExpertRecord(8, None, [[[3, 1]], [[0, 2]]], 4, [0.75]),
            m.ExpertRecord(9, "nothing was recorded."),
            node, ([Proposal(3, True, False, 2, True, True, 4, held=5, drafting=True)], node), node.rooms[0],
            m.EngineStart("ipc:///tmp/x/commands", "ipc:///tmp/x/events", 4321, {"a config": [1, 2]})]


def test_every_message_type_survives_the_codec_whole():
    kinds = {m.Command: (m.Submit, m.Abort, m.Ask, m.Shutdown),
             m.Event: (m.Ready, m.StepDone, m.States, m.Flushed, m.ExpertRecord, m.CallFailed)}
    seen = set()
    for msg in one_of_each():
        kind = next((k for k, members in kinds.items() if isinstance(msg, members)), None)
        if isinstance(msg, tuple):
            back = m.frame_reader(m.NodeMessage)(m.encode(msg))
        else:
            back = m.Reader(kind or type(msg))(m.encode(msg))
        assert back == msg and type(back) is type(msg)
        seen.add(type(msg[1] if isinstance(msg, tuple) else msg))
    defined = {c for _, c in inspect.getmembers(m, inspect.isclass)
               if c.__module__ == m.__name__ and issubclass(c, msgspec.Struct) and c not in (m.EngineFacts, m.Counters)}
    assert defined <= seen  # a new message type needs a case here


def test_a_malformed_or_unknown_message_is_refused_in_one_sentence():
    read = m.Reader(m.Command)
    frames = [b"\xc1", b"\x80", m.encode(["Nope", 1]), m.encode(m.Ready([])),  # not MessagePack, a map, an unknown
              m.encode(["Submit", "zero", None]), m.encode(["Abort", 1]),  # kind, an event, wrong and missing fields,
              m.encode(["Ask", 1, 0, "delete_everything"])]  # a question that is not one
    for frame in frames:
        with pytest.raises(m.WireError) as e:
            read(frame)
        assert str(e.value) and "\n" not in str(e.value)
    with pytest.raises(m.WireError, match="Invalid value 'Nope'"):
        read(m.encode(["Nope", 1]))


def test_the_server_fails_every_request_on_a_malformed_event_instead_of_hanging():
    import zmq

    from jaxdp.engine.ipc.remote import EngineProcess
    from jaxdp.engine.ipc.streams import Result

    ctx = zmq.Context()
    link = object.__new__(EngineProcess)
    link._events = ctx.socket(zmq.PULL)
    link._events.bind("inproc://events")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://events")
    killed, failed = [], []
    link.proc = SimpleNamespace(poll=lambda: None, kill=lambda: killed.append(True), returncode=None)
    link._stopping, link.failed, link._read_event = False, None, m.Reader(m.Event)
    link.engines = [SimpleNamespace(fail=failed.append)]
    link._calls = {1: Result()}
    push.send(m.encode(m.States(9, {})))  # an answer nobody waits for: dropped
    push.send(b"\xc1")
    reader = threading.Thread(target=link._read)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and killed
    assert link.failed.startswith("the engine process sent a message that is not one of its events (")
    assert "\n" not in link.failed and failed == [link.failed] and link._calls[1].wait(0) is None
    push.close(linger=0)
    ctx.term()


def test_the_engine_process_ends_in_one_line_on_a_malformed_command(tmp_path, caplog):
    import zmq

    from jaxdp.engine.ipc.process import ServerWatch, serve_engines

    ctx = zmq.Context()
    commands, events = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    commands.bind(f"ipc://{tmp_path}/commands")
    events.bind(f"ipc://{tmp_path}/events")
    engine = SimpleNamespace(facts=facts(), started=[], start=lambda wakeups: engine.started.append(wakeups),
                             shutdown=lambda: engine.started.append("shutdown"))
    threading.Thread(target=lambda: commands.send(b"\x93\xa5Abort"), daemon=True).start()  # blocks until connected
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = serve_engines([engine], f"ipc://{tmp_path}/commands", f"ipc://{tmp_path}/events",
                             ServerWatch(None, os.getppid()))
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert code == 1 and engine.started[-1] == "shutdown"
    assert m.Reader(m.Event)(events.recv()) == m.Ready([engine.facts])
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1 and lines[0].startswith("the server's process sent a command that is not the engine ")
    commands.close(linger=0)
    events.close(linger=0)
    ctx.term()


def test_the_engine_and_the_engine_process_stand_in_are_engine_clients():
    from jaxdp.engine import Engine
    from jaxdp.engine.ipc.client import EngineClient
    from jaxdp.engine.ipc.remote import RemoteEngine
    from jaxdp.testing import HostOnlyRunner

    cfg = EngineConfig(max_running_requests=4, chunked_prefill_size=16, decode_buckets=[1, 2], extend_buckets=[8])
    engine = Engine(HostOnlyRunner("tiny", "dp=2", 16, 4), "dp=2", cfg)
    stand_in = RemoteEngine(SimpleNamespace(failed=None, proc=SimpleNamespace(poll=lambda: None)), 0, facts(), None)
    assert isinstance(engine, EngineClient) and isinstance(stand_in, EngineClient)
    assert (engine.facts.num_pages, engine.facts.page_size) == (16, 4)  # the runner's pool
    # both refuse a prompt past the context by the one rule, on their own facts (64 tokens here, 32 in the facts)
    with pytest.raises(Exception, match="the prompt has 64 tokens but a rank holds at most 64"):
        engine.make_request(list(range(64)), SamplingParams())
    with pytest.raises(Exception, match="the prompt has 32 tokens but a rank holds at most 32"):
        stand_in.make_request(list(range(32)), SamplingParams())
