"""The engine in a process of its own (`--engine-process`): the server's side. See `jaxdp.engine.ipc.process`.

`EngineProcess` spawns `python -m jaxdp.serve --engine-child`, writes it one `EngineStart` on its stdin (the server's
checked config and the sockets' addresses), waits until it is ready (or repeats its start-up error's exit status),
and runs one thread that reads everything the child sends.
`RemoteEngine` is what the server holds for each of the child's engines: an `EngineClient` as `jaxdp.Engine` is
(requests are made and checked here with the engine's own admission rule, on the facts the child sent; streams,
the controller and metrics see stand-in requests), so `ReplicaSet`, the endpoints and the monitor do not know
where the engine runs. The sockets carry typed messages of `jaxdp.engine.ipc.messages`; a message from the child
that is not one of them fails the server as the child's death does: every request in flight ends with a 503
error and /health fails.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from jaxdp.engine.ipc import messages as msg
from jaxdp.engine.ipc import updates
from jaxdp.engine.ipc.client import ClientBase, DelayerCounters, EngineFailed
from jaxdp.engine.ipc.process import LIFELINE_ENV
from jaxdp.engine.ipc.streams import Result, Wakeups
from jaxdp.engine.sched.request import Request
from jaxdp.engine.step.step_stats import StepStats
from jaxdp.engine.threads import start_thread
from jaxdp.eplb.distribution import ExpertDistribution, RecordOutcome

log = logging.getLogger("jaxdp.serve")

CALL_TIMEOUT_S = 40.0  # a flush waits up to 30 s for every node in the child
STATES_FOR_S = 0.05  # how long the child's answer about its ranks' figures stands


class EngineProcessError(RuntimeError):
    """The engine process did not start; `code` is its exit status (it printed why)."""

    def __init__(self, code: int):
        super().__init__(f"the engine process exited with status {code}")
        self.code = code


class EngineProcess:
    """The engine process, seen from the server: `command` is the child's Python arguments (`-m jaxdp.serve
    --engine-child`), `config` what it builds its engines from (sent in its `EngineStart`)."""

    def __init__(self, command: list[str], config: Any, tokenizer, *, start_timeout_s: float = 3600.0):
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
        self._read_event = msg.Reader(msg.Event)
        self._calls: dict[int, Result] = {}
        self._call_ids = itertools.count()
        start = msg.EngineStart(*addrs, os.getpid(), config)  # the child ends if this pid is no longer its parent
        # the child's lifeline (`ServerWatch`): this process holds the only write end, which the kernel closes when
        # it dies however it dies (os.pipe's ends are not inherited by any other child)
        lifeline, self._lifeline = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, *command], stdin=subprocess.PIPE, pass_fds=(lifeline,),
                                         env={**os.environ, LIFELINE_ENV: str(lifeline)})
        except BaseException:
            self._close()
            raise
        finally:
            os.close(lifeline)
        try:
            try:
                self.proc.stdin.write(msg.encode(start))
                self.proc.stdin.close()
            except BrokenPipeError:  # it died before reading: `_wait_ready` repeats its exit status
                pass
            self.engines = self._wait_ready(tokenizer, start_timeout_s)
        except BaseException:  # stopped while the child starts (SIGTERM, Ctrl-C): no child is left behind
            self._end_child()
            raise
        self.failed: str | None = None
        self._stopping = False
        self._reader = start_thread(self._read, "jaxdp-engine-link")

    def _wait_ready(self, tokenizer, timeout_s: float) -> list[RemoteEngine]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._events.poll(500):
                try:
                    event = self._read_event(self._events.recv())
                except msg.WireError as e:
                    self.proc.kill()
                    self._close()
                    print(f"error: the engine process sent a message that is not one of its events ({e}); check "
                          "that the server and its engine process run the same jaxdp", file=sys.stderr)
                    raise EngineProcessError(1) from None
                if isinstance(event, msg.Ready):
                    return [RemoteEngine(self, i, f, tokenizer) for i, f in enumerate(event.engines)]
            elif (code := self.proc.poll()) is not None:
                self._close()
                raise EngineProcessError(code)  # it printed its one sentence already
        self.proc.kill()
        self._close()
        print(f"error: the engine process was not ready within {timeout_s:.0f} s (see its log above)", file=sys.stderr)
        raise EngineProcessError(1)

    # ---- to the child ----------------------------------------------------------------------------
    def send(self, command: msg.Submit | msg.Abort | msg.Ask | msg.Shutdown) -> None:
        import zmq

        data = msg.encode(command)
        with self._send_lock:
            if self._commands.closed:  # (after shutdown, a late abort of a stream goes nowhere)
                return
            try:  # no wait: with no child on the other end (it died) a send would block for ever
                self._commands.send(data, zmq.NOBLOCK)
            except zmq.Again:  # the reader finds the child gone and fails every request
                pass

    def call(self, what: str, index: int):
        """Ask the child and wait for its answer (the rare questions, not the tokens): "rank_states" (every rank's
        figures of engine `index`) or "flush_cache" (its flush's reports)."""
        if self.failed:
            raise EngineFailed(self.failed)
        call_id, result = next(self._call_ids), Result()
        self._calls[call_id] = result
        self.send(msg.Ask(call_id, index, what))
        answer = result.wait(CALL_TIMEOUT_S)
        self._calls.pop(call_id, None)
        if answer is None:
            raise EngineFailed(self.failed or f"the engine process did not answer {what} within "
                               f"{CALL_TIMEOUT_S:.0f} s")
        if isinstance(answer, msg.CallFailed):
            raise RuntimeError(f"the engine process failed {what}: {answer.error}")
        if isinstance(answer, msg.ExpertRecord):
            return answer
        return answer.states if isinstance(answer, msg.States) else answer.reports

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
                try:
                    event = self._read_event(self._events.recv())
                    if isinstance(event, msg.Ready):
                        raise msg.WireError("a second Ready")
                    if isinstance(event, msg.StepDone) and not 0 <= event.engine < len(self.engines):
                        raise msg.WireError(f"a step of engine {event.engine}; it runs {len(self.engines)}")
                except msg.WireError as e:
                    self.proc.kill()
                    self._lost(f"the engine process sent a message that is not one of its events ({e}); check that "
                               "the server and its engine process run the same jaxdp, and restart the server")
                    return
                if isinstance(event, msg.StepDone):
                    self.engines[event.engine].receive(event)
                else:
                    result = self._calls.get(event.call)
                    if result is not None:
                        result.set_result(event)
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
                self.send(msg.Shutdown())
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop within 30 s; killing it")
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(timeout=5)
        self._close()

    def _end_child(self) -> None:
        """Kill the child if it still runs, wait for it, and close everything (a start that does not finish)."""
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if not self._commands.closed:
            self._close()

    def _close(self) -> None:
        if self._lifeline is not None:  # (a child still running sees its lifeline end)
            os.close(self._lifeline)
            self._lifeline = None
        with self._send_lock:
            self._commands.close(linger=0)
        if not self._events.closed:  # (the reader never started)
            self._events.close(linger=0)
        self._ctx.term()
        self._dir.cleanup()


class RemoteEngine(ClientBase):
    """One of the child's engines, as the server uses a `jaxdp.Engine`: an EngineClient."""

    def __init__(self, link: EngineProcess, index: int, facts: msg.EngineFacts, tokenizer):
        self.link, self.index, self.facts, self.tokenizer = link, index, facts, tokenizer
        self.failed: str | None = None
        self._init_intake()
        self.stats = StepStats(facts.layout.dp)
        self.delayer = DelayerCounters() if facts.cfg.prefill_delayer else None
        self.accepts_grammars = facts.cfg.grammar_backend != "none"  # (the child's engine was given its Grammars)
        self.compiles = 0
        self.requests: dict[str, Request] = {}  # submitted and not finished
        self.wakeups = Wakeups()
        self._messages = 0  # step messages received
        self._states: dict[int, dict] = {}
        self._states_at, self._states_seen = -1e9, (-1, -1)
        self._flushes = 0  # flushes answered: the ranks' figures are asked afresh after one

    # ---- requests (the event loop) ----------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        req.submitted = True
        if not self.failed:
            self.requests[req.rid] = req
            self.link.send(msg.Submit(self.index, updates.sent(req)))
        failed = self.failed or self.link.failed  # (the child may have died while this was sent)
        if failed and not req.finished and self.requests.pop(req.rid, req) is req:
            self._end(req, failed)
            self.wakeups.deliver()
        return req

    def abort(self, rid: str) -> None:
        self.link.send(msg.Abort(self.index, rid))

    def stream(self, req: Request):
        return self.wakeups.stream(req, self.submit, self.abort)

    # ---- from the child (the link's thread) -------------------------------------------------------
    def receive(self, step: msg.StepDone) -> None:
        updates.apply(self.requests, step.updates, time.perf_counter())
        for update in step.updates:
            if update.finish is not None:
                self.requests.pop(update.rid, None)
        self.stats.records.extend(step.records)
        self.stats.steps, self.stats.compiles_in_steps = step.steps, step.compiles_in_steps
        if (c := step.counters) is not None:
            self.compiles = c.compiles
            if self.delayer is not None and c.delayer_wait_passes is not None:
                self.delayer.wait_passes = c.delayer_wait_passes
                self.delayer.outcomes.update(c.delayer_outcomes or {})
        if step.failed and not self.failed:
            self.failed = step.failed
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

    # ---- the rest of an EngineClient ---------------------------------------------------------------
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
                    return self.facts.empty_states[rank]
                self._states, self._states_at, self._states_seen = states, now, seen
            return self._states[rank]
        return self.facts.empty_states[rank]  # nothing runs any more: the figures of an empty rank

    def flush_cache(self):
        """The child's flush; the ranks' figures are asked afresh after it (the flush freed pages, no step ran),
        so /metrics and /get_load read right after the answer show the freed pool."""
        try:
            return self.link.call("flush_cache", self.index)
        finally:
            self._flushes += 1

    def expert_record(self, action: str) -> RecordOutcome:
        """The child's expert-distribution recorder action (`jaxdp.engine.loop.Engine.expert_record`)."""
        a = self.link.call(f"expert_record_{action}", self.index)
        if a.per_device is None:
            return RecordOutcome(error=a.error)
        return RecordOutcome(ExpertDistribution(np.asarray(a.per_device, np.int64), a.steps,
                                                None if a.balancedness is None else np.asarray(a.balancedness)))

    @property
    def is_running(self) -> bool:
        return not self.failed and not self.link.failed and self.link.proc.poll() is None

    def start(self) -> None:
        """The child started its loops before it said it was ready."""

    def shutdown(self) -> None:
        self.link.shutdown()
