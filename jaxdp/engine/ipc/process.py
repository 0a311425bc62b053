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
streams. This process ends when told to, or within moments once the server's process is gone, at any point of its
life, start-up included (`ServerWatch`): the server holds the write end of a pipe whose read end only this process
has (its fd in `LIFELINE_ENV`); the kernel closes that end when the server dies however it dies, and the read here
then sees its end.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import BinaryIO, NoReturn

from jaxdp.engine.ipc import messages as msg
from jaxdp.engine.ipc import updates
from jaxdp.engine.step.step_stats import compiles_total
from jaxdp.eplb.distribution import RecordOutcome

log = logging.getLogger("jaxdp.serve")

SNAPSHOT_EVERY_S = 0.25  # the delayer's counters and the compile count: four times a second is enough
LIFELINE_ENV = "JAXDP_ENGINE_LIFELINE"  # the engine process's fd of the pipe whose write end only the server holds
WATCH_EVERY_S = 0.5  # how often the watch also checks this process's parent (without a lifeline, the only check)
SERVER_GONE_STATUS = 1


class ServerWatch:
    """Ends this process within moments once the server's process is gone, whatever this process is doing then
    (importing, loading the model, compiling the steps, serving): a daemon thread waits on the lifeline pipe (its
    read end `lifeline_fd`, the server holding the only write end), which reads its end when the server dies, even
    by SIGKILL; it checks too that this process's parent is still the server's pid `parent`. Then it logs one line
    and `os._exit`s with SERVER_GONE_STATUS: nothing here is worth keeping for a server that is gone, and an orderly
    stop could wait on a compilation for minutes.

    Not PR_SET_PDEATHSIG: that signal follows the thread that spawned this process (a server that started it
    from a worker thread would lose it when that thread ends), and a SIGKILL leaves no line in the log."""

    def __init__(self, lifeline_fd: int | None, parent: int):
        self.lifeline_fd, self.parent = lifeline_fd, parent
        self._ending = threading.Lock()  # one line, however many places find the server gone at once

    @classmethod
    def from_env(cls) -> ServerWatch:
        """The watch of this process's parent, over the lifeline the server passed in LIFELINE_ENV (if any)."""
        fd = os.environ.pop(LIFELINE_ENV, None)
        return cls(int(fd) if fd and fd.isdigit() else None, os.getppid())

    def start(self) -> ServerWatch:
        threading.Thread(target=self._watch, name="jaxdp-server-watch", daemon=True).start()
        return self

    def expect(self, parent: int) -> None:
        """The server's pid as it wrote it in its `EngineStart`: ends this process at once if that is not (any
        longer) the parent."""
        self.parent = parent
        self.check()

    def check(self) -> None:
        if os.getppid() != self.parent:
            self.server_gone()

    def _watch(self) -> None:
        while True:
            if self.lifeline_fd is None:
                time.sleep(WATCH_EVERY_S)
            elif select.select([self.lifeline_fd], [], [], WATCH_EVERY_S)[0]:
                try:
                    if not os.read(self.lifeline_fd, 4096):
                        self.server_gone()
                except OSError:
                    self.server_gone()
            self.check()

    def server_gone(self) -> NoReturn:
        with self._ending:
            log.warning("the server's process is gone; the engine process ends")
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(SERVER_GONE_STATUS)


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


def serve_engines(engines: list, commands_addr: str, events_addr: str, watch: ServerWatch) -> int:
    """Run the engines' loops for the server's process that `watch` watches (it ends this process once that is
    gone), its commands read from `commands_addr` and the events sent to `events_addr`; returns the exit status
    once told to stop (0) or on a command that is not the engine process's (1)."""
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
        watch.check()  # (it may have gone during the build)
        _send(replies, msg.Ready([e.facts for e in engines]))
        while True:
            if not commands.poll(1000):
                watch.check()
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


def _answer(engine, ask: msg.Ask) -> msg.States | msg.Flushed | msg.ExpertRecord | msg.CallFailed:
    try:  # an answer, not a dead engine process
        if ask.question == "rank_states":
            return msg.States(ask.call, {rank: engine.rank_state(rank) for rank in engine.local_ranks})
        if ask.question.startswith("expert_record_"):
            return _expert_record(ask.call, engine.expert_record(ask.question.removeprefix("expert_record_")))
        return msg.Flushed(ask.call, engine.flush_cache())
    except Exception as e:
        return msg.CallFailed(ask.call, f"{type(e).__name__}: {e}")


def _expert_record(call: int, out: RecordOutcome) -> msg.ExpertRecord:
    d = out.distribution
    if d is None:
        return msg.ExpertRecord(call, out.error)
    return msg.ExpertRecord(call, None, d.per_device.tolist(), d.steps,
                            None if d.balancedness is None else d.balancedness.tolist())
