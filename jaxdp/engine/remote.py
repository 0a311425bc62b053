"""The engine in a process of its own (`--engine-process`): the server's side. See `jaxdp.engine.process`.

`EngineProcess` spawns `python -m jaxdp.serve <the same flags> --engine-child ADDRS`, waits until it is ready
(or repeats its start-up error's exit status), and runs one thread that reads everything the child sends.
`RemoteEngine` is what the server holds for each of the child's engines: the same surface as `jaxdp.Engine`
where the server uses it (requests are made and checked here with the engine's own rules; streams, the
controller and metrics see stand-in requests), so `ReplicaSet`, the endpoints and the monitor do not know
where the engine runs. If the child dies, every request in flight ends with a 503 error and /health fails.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

from jaxdp.engine import updates
from jaxdp.engine.controller import Controller
from jaxdp.engine.engine import Engine, EngineFailed
from jaxdp.engine.pool import PagePool, PrefixCache
from jaxdp.engine.request import Request
from jaxdp.engine.scheduler import Scheduler
from jaxdp.engine.stats import StepStats
from jaxdp.engine.streams import Result, Wakeups
from jaxdp.engine.threads import start_thread

log = logging.getLogger("jaxdp.serve")

CALL_TIMEOUT_S = 40.0  # a flush waits up to 30 s for every node in the child
STATES_FOR_S = 0.05  # how long the child's answer about its ranks' figures stands


class EngineProcessError(RuntimeError):
    """The engine process did not start; `code` is its exit status (it printed why)."""

    def __init__(self, code: int):
        super().__init__(f"the engine process exited with status {code}")
        self.code = code


class EngineProcess:
    def __init__(self, argv: list[str], tokenizer, *, start_timeout_s: float = 3600.0):
        import zmq

        self._dir = tempfile.TemporaryDirectory(prefix="jaxdp-engine-")
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._events = self._ctx.socket(zmq.PULL)
        addrs = []
        for sock, name in ((self._commands, "commands"), (self._events, "events")):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM if sock is self._commands else zmq.RCVHWM, 0)  # queue, never block
            addrs.append(f"ipc://{self._dir.name}/{name}")
            sock.bind(addrs[-1])
        self._send_lock = threading.Lock()  # the event loop, the monitor and /flush_cache all send
        self._calls: dict[int, Result] = {}
        self._call_ids = itertools.count()
        child = ",".join([*addrs, str(os.getpid())])  # the child ends if this pid is no longer its parent
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxdp.serve", *argv, "--engine-child", child])
        self.engines = self._wait_ready(tokenizer, start_timeout_s)
        self.failed: str | None = None
        self._stopping = False
        self._reader = start_thread(self._read, "jaxdp-engine-link")

    def _wait_ready(self, tokenizer, timeout_s: float) -> list[RemoteEngine]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._events.poll(500):
                msg = pickle.loads(self._events.recv())
                if msg[0] == "ready":
                    return [RemoteEngine(self, i, f, tokenizer) for i, f in enumerate(msg[1])]
            elif (code := self.proc.poll()) is not None:
                self._close()
                raise EngineProcessError(code)  # it printed its one sentence already
        self.proc.kill()
        self._close()
        print(f"error: the engine process was not ready within {timeout_s:.0f} s (see its log above)", file=sys.stderr)
        raise EngineProcessError(1)

    # ---- to the child ----------------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        import zmq

        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self._commands.closed:  # (after shutdown, a late abort of a stream goes nowhere)
                return
            try:  # no wait: with no child on the other end (it died) a send would block for ever
                self._commands.send(data, zmq.NOBLOCK)
            except zmq.Again:  # the reader finds the child gone and fails every request
                pass

    def call(self, what: str, index: int, *args):
        """Ask the child and wait for its answer (the rare questions, not the tokens)."""
        if self.failed:
            raise EngineFailed(self.failed)
        call_id, result = next(self._call_ids), Result()
        self._calls[call_id] = result
        self.send(("call", call_id, what, index, args))
        answer = result.wait(CALL_TIMEOUT_S)
        self._calls.pop(call_id, None)
        if answer is None:
            raise EngineFailed(self.failed or f"the engine process did not answer {what} within "
                               f"{CALL_TIMEOUT_S:.0f} s")
        ok, value = answer
        if not ok:
            raise RuntimeError(f"the engine process failed {what}: {value}")
        return value

    # ---- from the child --------------------------------------------------------------------------
    def _read(self) -> None:
        """This thread alone reads the events socket, and closes it when it ends."""
        try:
            while not self._stopping:
                if not self._events.poll(200):
                    if self.proc.poll() is not None and not self._stopping:
                        self._lost(f"the engine process exited unexpectedly (status {self.proc.returncode}); "
                                   "see the log above, and restart the server")
                        return
                    continue
                msg = pickle.loads(self._events.recv())
                if msg[0] == "step":
                    self.engines[msg[1]].receive(*msg[2:])
                elif msg[0] == "reply":
                    result = self._calls.get(msg[1])
                    if result is not None:
                        result.set_result((msg[2], msg[3]))
        finally:
            self._events.close(linger=0)

    def _lost(self, message: str) -> None:
        log.error("%s; the server stops serving", message)
        self.failed = message
        for engine in self.engines:
            engine.fail(message)
        for result in list(self._calls.values()):
            result.set_result(None)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self.proc.poll() is None:
            try:
                self.send(("shutdown",))
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop within 30 s; killing it")
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(timeout=5)
        self._close()

    def _close(self) -> None:
        with self._send_lock:
            self._commands.close(linger=0)
        if not self._events.closed:  # (the reader never started)
            self._events.close(linger=0)
        self._ctx.term()
        self._dir.cleanup()


class RemoteEngine:
    """One of the child's engines, as the server uses a `jaxdp.Engine`."""

    def __init__(self, link: EngineProcess, index: int, facts: dict, tokenizer):
        self.link, self.index, self.tokenizer = link, index, tokenizer
        self.layout, self.cfg, self.buckets = facts["layout"], facts["cfg"], facts["buckets"]
        self.model_cfg, self.context_len = facts["model_cfg"], facts["context_len"]
        self.local_ranks = facts["local_ranks"]
        self.compiles_at_warmup = facts["compiles_at_warmup"]
        pool = PagePool(facts["num_pages"], facts["page_size"])
        # the engine's own admission rule, with a pool of the same size: a rank's figures say nothing here
        checker = Scheduler(0, pool, PrefixCache(pool, False), facts["sched_cfg"], None)
        self.schedulers = [checker] * self.layout.dp
        self.controller = Controller(self.layout.dp, self.cfg.load_balance_method)
        self.stats = StepStats(self.layout.dp)
        self.delayer = SimpleNamespace(wait_passes=0, outcomes={}) if self.cfg.prefill_delayer else None
        self.compiles = 0
        self.failed: str | None = None
        self.requests: dict[str, Request] = {}  # submitted and not finished
        self.wakeups = Wakeups()
        self._ids = itertools.count()
        self._messages = 0  # step messages received
        self._states: dict[int, dict] = {}
        self._states_at, self._states_seen = -1e9, (-1, -1)
        self._flushes = 0  # flushes answered: the ranks' figures are asked afresh after one

    # ---- requests (the event loop) ----------------------------------------------------------------
    # The engine's own: it reads `failed`, `_ids`, `controller`, `tokenizer`, `model_cfg` and the admission
    # check of `schedulers[0]`, which this stand-in has too, so a request is refused here exactly as there.
    make_request = Engine.make_request

    def submit(self, req: Request) -> Request:
        req.submitted = True
        if not self.failed:
            self.requests[req.rid] = req
            self.link.send(("submit", self.index, updates.sent(req)))
        failed = self.failed or self.link.failed  # (the child may have died while this was sent)
        if failed and not req.finished and self.requests.pop(req.rid, req) is req:
            self._end(req, failed)
            self.wakeups.deliver()
        return req

    def abort(self, rid: str) -> None:
        self.link.send(("abort", self.index, rid))

    def stream(self, req: Request):
        return self.wakeups.stream(req, self.submit, self.abort)

    # ---- from the child (the link's thread) -------------------------------------------------------
    def receive(self, batch: list, records: list, steps: int, compiles_in_steps: int, failed: str | None,
                snapshot: dict | None) -> None:
        updates.apply(self.requests, batch, time.perf_counter())
        for update in batch:
            if update[5] is not None:  # finished
                self.requests.pop(update[0], None)
        self.stats.records.extend(records)
        self.stats.steps, self.stats.compiles_in_steps = steps, compiles_in_steps
        if snapshot is not None:
            self.compiles = snapshot["compiles"]
            if self.delayer is not None and snapshot["delayer"] is not None:
                self.delayer.wait_passes, self.delayer.outcomes = snapshot["delayer"]
        if failed and not self.failed:
            self.failed = failed
        self._messages += 1  # a step ran: the ranks' figures are asked afresh
        self.wakeups.deliver()

    def fail(self, message: str) -> None:
        """The child is gone: every request in flight ends with the message (HTTP 503)."""
        self.failed = message
        for req in list(self.requests.values()):
            if not req.finished:
                self._end(req, message)
        self.requests.clear()
        self.wakeups.deliver()

    @staticmethod
    def _end(req: Request, message: str) -> None:
        """End a request the child will not finish, with the message (HTTP 503)."""
        req.error_status = 503
        updates.end(req, "abort", message, time.perf_counter())

    # ---- the rest of an Engine's surface ----------------------------------------------------------
    def rank_state(self, rank: int) -> dict:
        """The rank's figures from the child: one question answers every rank, and stands for 50 ms unless a
        step ran meanwhile (so /metrics or /get_load over all ranks holds the event loop for one round trip,
        not one per rank, and never shows a request its client already has the end of)."""
        if not (self.failed or self.link.failed):
            now, seen = time.monotonic(), (self._messages, self._flushes)
            if now - self._states_at > STATES_FOR_S or seen != self._states_seen:
                try:
                    states = self.link.call("rank_states", self.index)
                except EngineFailed:  # it died meanwhile
                    return self.schedulers[0].state()
                self._states, self._states_at, self._states_seen = states, now, seen
            return self._states[rank]
        return self.schedulers[0].state()  # nothing runs any more: the figures of an empty rank

    def flush_cache(self):
        """The child's flush; the ranks' figures are asked afresh after it (the flush freed pages, no step ran),
        so /metrics and /get_load read right after the answer show the freed pool."""
        try:
            return self.link.call("flush_cache", self.index)
        finally:
            self._flushes += 1

    @property
    def is_running(self) -> bool:
        return not self.failed and not self.link.failed and self.link.proc.poll() is None

    def start(self) -> None:
        """The child started its loops before it said it was ready."""

    def shutdown(self) -> None:
        self.link.shutdown()
