"""The engine in a process of its own (`python -m jaxdp.serve --engine-process`): this process's side.

SGLang runs its scheduler in one process and HTTP, tokenization and streaming in another (its tokenizer
manager); vLLM's engine core is a process of its own too. Then the HTTP side takes neither CPU nor the
interpreter lock from the loop that feeds the devices. Here the server's process checks the flags, spawns this
one and writes it one `EngineStart` on its stdin (`read_start`): the checked config and where its sockets are.
This process builds the engines from that config exactly as the server would (every start-up error is the same
one sentence and exit status), starts their loops and then only carries messages, over two ZeroMQ sockets on a
local path, typed messages of `jaxdp.engine.ipc.messages` (one codec, no pickle):

- in, `Command`s: `Submit` (an engine, a request), `Abort`, `Ask` for the rare questions (the ranks' figures, a
  prefix-cache flush), `Shutdown`;
- out, `Event`s: `Ready` (each engine's `EngineFacts`) once; after every step of an engine `StepDone` (its
  requests' `Update`s from `jaxdp.engine.ipc.updates`, its new step records, counters, failure), one message a
  step however many requests ran; `States`, `Flushed` or `CallFailed` to answer a question.

A command that is not one of these ends this process with one line saying so (the server then fails its
requests with a 503), never a guess at what it meant.

The server's side (`jaxdp.engine.ipc.remote`) applies the updates to its stand-in requests and wakes the
streams. This process ends when told to, or when the server's process is gone.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from typing import BinaryIO

from jaxdp.engine.ipc import messages as msg
from jaxdp.engine.ipc import updates
from jaxdp.engine.step.step_stats import compiles_total

log = logging.getLogger("jaxdp.serve")

SNAPSHOT_EVERY_S = 0.25  # the delayer's counters and the compile count: four times a second is enough


def _socket(ctx, kind: int, addr: str):
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, 0)  # queue while the server reads; `_send` never blocks
    sock.connect(addr)
    return sock


def _send(sock, message) -> None:
    """Send without waiting: with the server's process gone there is nobody to wait for (this process then
    ends at the next poll)."""
    import zmq

    try:
        sock.send(msg.encode(message), zmq.NOBLOCK)
    except zmq.Again:
        pass


class Outbox:
    """Stands in for an engine's `Wakeups` here: notes the requests a step changed (their `on_update`) and,
    where the loop would wake the streams, sends their updates in one message."""

    def __init__(self, index: int, engine, sock):
        self.index, self.engine, self.sock = index, engine, sock
        self._lock = threading.Lock()  # the loop sends; a failure elsewhere (Engine.fail) may send too
        self._touched: dict[str, object] = {}
        self.sent: dict[str, int] = {}  # rid -> tokens reported so far
        self._steps_sent = 0
        self._snapshot_at = 0.0

    def note(self, req) -> None:
        self._touched[req.rid] = req

    def deliver(self) -> None:
        with self._lock:
            touched, self._touched = self._touched, {}
            out = []
            for rid, req in touched.items():
                update, self.sent[rid] = updates.report(req, self.sent.get(rid, 0))
                if update is not None:
                    out.append(update)
                if req.finished:
                    self.sent.pop(rid, None)
            stats = self.engine.stats
            new = min(stats.steps - self._steps_sent, len(stats.records))
            records = list(itertools.islice(reversed(stats.records), new))[::-1] if new > 0 else []
            self._steps_sent = stats.steps
            now = time.perf_counter()
            counters = None
            if now - self._snapshot_at >= SNAPSHOT_EVERY_S:
                d = self.engine.delayer
                counters = msg.Counters(compiles_total(), None if d is None else d.wait_passes,
                                    None if d is None else dict(d.outcomes))
                self._snapshot_at = now
            if not out and not records and counters is None and not self.engine.failed:
                return
            _send(self.sock, msg.StepDone(self.index, out, records, stats.steps, stats.compiles_in_steps,
                                      self.engine.failed, counters))


def read_start(stream: BinaryIO, config_type: type) -> msg.EngineStart:
    """The server's `EngineStart` from `stream` (this process's stdin, read to its end), its config read as
    `config_type`; anything else is a WireError in one sentence."""
    return msg.Reader(msg.EngineStart[config_type])(stream.read())


def serve_engines(engines: list, commands_addr: str, events_addr: str, parent: int) -> int:
    """Run the engines' loops for the server's process `parent` (its pid from before the build: it may have gone
    meanwhile), its commands read from `commands_addr` and the events sent to `events_addr`; returns the exit
    status once told to stop (0) or once that process is gone (1)."""
    import zmq

    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C (or a stop) may reach the whole group: the server
        signal.signal(sig, signal.SIG_IGN)  # drains first, then tells this process to stop
    ctx = zmq.Context()
    commands = _socket(ctx, zmq.PULL, commands_addr)
    replies = _socket(ctx, zmq.PUSH, events_addr)
    outboxes = []
    for i, engine in enumerate(engines):
        outboxes.append(Outbox(i, engine, _socket(ctx, zmq.PUSH, events_addr)))
        engine.start(wakeups=outboxes[-1])  # the loop "wakes the streams" by sending their updates
    read = msg.Reader(msg.Command)
    code = 1
    try:
        if os.getppid() != parent:
            log.warning("the server's process is gone; the engine process ends")
            return code
        _send(replies, msg.Ready([e.facts for e in engines]))
        while True:
            if not commands.poll(1000):
                if os.getppid() != parent:
                    log.warning("the server's process is gone; the engine process ends")
                    break
                continue
            try:
                cmd = read(commands.recv())
            except msg.WireError as e:
                log.error("the server's process sent a command that is not the engine process's (%s); the engine "
                          "process ends", e)
                break
            if isinstance(cmd, msg.Shutdown):
                code = 0
                break
            if not 0 <= cmd.engine < len(engines):
                log.error("the server's process named engine %d of %d; the engine process ends", cmd.engine,
                          len(engines))
                break
            engine = engines[cmd.engine]
            if isinstance(cmd, msg.Submit):
                req = updates.received(cmd.request, engine.tokenizer)
                req.on_update = outboxes[cmd.engine].note
                engine.submit(req)
            elif isinstance(cmd, msg.Abort):
                engine.abort(cmd.rid)
            else:
                _send(replies, _answer(engine, cmd))
    finally:
        for engine in engines:
            engine.shutdown()
        ctx.destroy(linger=2000)
    return code


def _answer(engine, ask: msg.Ask) -> msg.States | msg.Flushed | msg.CallFailed:
    try:  # an answer, not a dead engine process
        if ask.question == "rank_states":
            return msg.States(ask.call, {rank: engine.rank_state(rank) for rank in engine.local_ranks})
        return msg.Flushed(ask.call, engine.flush_cache())
    except Exception as e:
        return msg.CallFailed(ask.call, f"{type(e).__name__}: {e}")
