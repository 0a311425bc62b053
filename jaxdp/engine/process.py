"""The engine in a process of its own (`python -m jaxdp.serve --engine-process`): this process's side.

SGLang runs its scheduler in one process and HTTP, tokenization and streaming in another (its tokenizer
manager); vLLM's engine core is a process of its own too. Then the HTTP side takes neither CPU nor the
interpreter lock from the loop that feeds the devices. Here the server's process spawns this one with the
same flags; it builds the engines exactly as the server would (every start-up error is the same one sentence
and exit status), starts their loops and then only carries messages, over two ZeroMQ sockets on a local
path:

- in: ("submit", engine, request fields), ("abort", engine, rid), ("call", id, what, engine, args) for the
  rare questions (the ranks' figures, a prefix-cache flush), ("shutdown",);
- out: ("ready", facts per engine) once; after every step of an engine ("step", engine, token updates, its
  new step records, counters, failure) with the token updates of `jaxdp.engine.updates`, one message a step
  however many requests ran; ("reply", id, ok, value) for a call.

The server's side (`jaxdp.engine.remote`) applies the updates to its stand-in requests and wakes the
streams. This process ends when told to, or when the server's process is gone.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import threading
import time

from jaxdp.engine import updates
from jaxdp.engine.stats import compiles_total

log = logging.getLogger("jaxdp.serve")

SNAPSHOT_EVERY_S = 0.25  # the delayer's counters and the compile count: four times a second is enough


def _socket(ctx, kind: int, addr: str):
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDHWM, 0)  # queue while the server reads; `_send` never blocks
    sock.connect(addr)
    return sock


def _send(sock, msg: tuple) -> None:
    """Send without waiting: with the server's process gone there is nobody to wait for (this process then
    ends at the next poll)."""
    import zmq

    try:
        sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), zmq.NOBLOCK)
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
                    self.engine.requests.pop(rid, None)
            stats = self.engine.stats
            new = min(stats.steps - self._steps_sent, len(stats.records))
            records = list(itertools.islice(reversed(stats.records), new))[::-1] if new > 0 else []
            self._steps_sent = stats.steps
            now = time.perf_counter()
            snapshot = None
            if now - self._snapshot_at >= SNAPSHOT_EVERY_S:
                d = self.engine.delayer
                snapshot = {"compiles": compiles_total(),
                            "delayer": None if d is None else (d.wait_passes, dict(d.outcomes))}
                self._snapshot_at = now
            if not out and not records and snapshot is None and not self.engine.failed:
                return
            _send(self.sock, ("step", self.index, out, records, stats.steps, stats.compiles_in_steps,
                              self.engine.failed, snapshot))


def facts(engine) -> dict:
    """What the server's side needs to know of an engine, once: what its stand-in says of itself."""
    s = engine.schedulers[0]
    return {"layout": engine.layout, "cfg": engine.cfg, "buckets": engine.buckets, "model_cfg": engine.model_cfg,
            "context_len": engine.context_len, "local_ranks": engine.local_ranks, "sched_cfg": s.cfg,
            "num_pages": s.pool.num_pages, "page_size": s.pool.page_size,
            "compiles_at_warmup": engine.compiles_at_warmup}


def serve_engines(engines: list, addrs: str) -> int:
    """Run the engines' loops for the server's process at `addrs` ("commands,events,its pid"); returns the
    exit status once told to stop (0) or once that process is gone (1)."""
    import zmq

    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C (or a stop) may reach the whole group: the server
        signal.signal(sig, signal.SIG_IGN)  # drains first, then tells this process to stop
    commands_addr, events_addr, parent = addrs.split(",")
    parent = int(parent)  # (the server's pid from before the build: it may have gone meanwhile)
    ctx = zmq.Context()
    commands = _socket(ctx, zmq.PULL, commands_addr)
    replies = _socket(ctx, zmq.PUSH, events_addr)
    outboxes = []
    for i, engine in enumerate(engines):
        outboxes.append(Outbox(i, engine, _socket(ctx, zmq.PUSH, events_addr)))
        engine.wakeups = outboxes[-1]  # the loop "wakes the streams" by sending their updates
        engine.start()
    code = 1
    try:
        if os.getppid() != parent:
            log.warning("the server's process is gone; the engine process ends")
            return code
        _send(replies, ("ready", [facts(e) for e in engines]))
        while True:
            if not commands.poll(1000):
                if os.getppid() != parent:
                    log.warning("the server's process is gone; the engine process ends")
                    break
                continue
            cmd = pickle.loads(commands.recv())
            if cmd[0] == "shutdown":
                code = 0
                break
            if cmd[0] == "submit":
                engine, outbox = engines[cmd[1]], outboxes[cmd[1]]
                req = updates.received(cmd[2], engine.tokenizer)
                req.on_update = outbox.note
                engine.submit(req)
            elif cmd[0] == "abort":
                engines[cmd[1]].abort(cmd[2])
            elif cmd[0] == "call":
                _, call_id, what, index, args = cmd
                try:
                    value, ok = _call(engines[index], what, args), True
                except Exception as e:  # an answer, not a dead engine process
                    value, ok = f"{type(e).__name__}: {e}", False
                _send(replies, ("reply", call_id, ok, value))
    finally:
        for engine in engines:
            engine.shutdown()
        ctx.destroy(linger=2000)
    return code


def _call(engine, what: str, args: tuple):
    if what == "rank_states":
        return {rank: engine.rank_state(rank) for rank in engine.local_ranks}
    if what == "flush_cache":
        return engine.flush_cache()
    raise ValueError(f"unknown call {what!r}")
