"""An Engine's side of the other nodes (several nodes, see `jaxdp.engine.hosts`): what rides on the exchange.

Node 0 (HTTP, controller) keeps a stand-in `Request` for each request it sends to another node's rank; the
message it posts each iteration carries those new requests and their aborts. Every other node adds what it
receives to its own schedulers, and its message carries back, per request, the tokens booked since the last
one (and the finish), plus its ranks' states a few times a second. Node 0 applies them to the stand-ins, so
streaming, metrics and the controller see remote requests as local ones. An admin command (a prefix-cache
flush) rides the same way: node 0 sends it, every node carries it out on its own ranks and answers, and
node 0 answers the HTTP request once every node has (`NodeFlush`, one per node). `watchdog` bounds every
wait on another node that the exchange's own timeout does not cover (a step that never finishes).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Protocol

from jaxdp.engine import updates as updates_mod
from jaxdp.engine.hosts import HostExchange, PeerFailure, PeerStopped
from jaxdp.engine.request import Request
from jaxdp.engine.scheduler import Scheduler
from jaxdp.engine.threads import start_thread
from jaxdp.parallel.places import Proposal

STATES_EVERY_S = 0.25  # rank states for /get_load and metrics: four times a second is enough


class EngineSide(Protocol):
    """What a NodeLink uses of its engine (`jaxdp.Engine`), so that this module need not import it."""

    requests: dict[str, Request]
    schedulers: list[Scheduler]
    local_ranks: range
    tokenizer: Any
    failed: str | None
    blocked: tuple[float, str] | None

    @property
    def is_running(self) -> bool: ...

    def submit(self, req: Request) -> Request: ...

    def abort(self, rid: str) -> None: ...

    def fail(self, message: str) -> None: ...


class NodeLink:
    def __init__(self, engine: EngineSide, hosts: HostExchange):
        self.engine, self.hosts = engine, hosts
        self.is_node_0 = hosts.node_rank == 0
        self.remote_state: dict[int, dict] = {}  # node 0: the other nodes' ranks' states
        self._outgoing: dict[str, list] = {"new": [], "abort": []}  # node 0: for other nodes' ranks
        self.origin: dict[str, int] = {}  # other nodes: node 0's requests here -> tokens reported back
        self._states_sent = 0.0
        self.node_0_stopped = False  # other nodes: node 0 said "stop" (an orderly end, not a failure)
        self._flush_ids = itertools.count(1)
        self._flushing: dict[int, tuple[Any, dict[int, NodeFlush]]] = {}  # node 0: id -> (result, answers)
        self._flush_answers: list[tuple[int, NodeFlush]] = []  # other nodes: answers for the next message

    # ---- node 0 -------------------------------------------------------------------------------------
    def forward(self, req: Request) -> None:
        """A request for another node's rank: it goes out with the next message; the stand-in stays here."""
        self.engine.requests[req.rid] = req
        self._outgoing["new"].append(updates_mod.sent(req))

    def forward_abort(self, req: Request, now: float) -> None:
        """The owning node frees the pages; the stand-in ends now."""
        self._outgoing["abort"].append(req.rid)
        updates_mod.end(req, "abort", None, now)

    def flush(self, result: Any) -> None:
        """/flush_cache on every node: node 0 flushes its ranks now and asks the others in the next message;
        `result.set_result` gets one NodeFlush per node once all have answered. Every request comes through
        node 0, so node 0 knows whether any runs anywhere: then no node flushes (as SGLang)."""
        hosts, engine = self.hosts, self.engine
        if engine.failed:  # the other nodes will not answer
            result.set_result(None)
            return
        busy = any(s.running or s.waiting for s in engine.schedulers) or any(
            not r.finished for r in engine.requests.values())
        mine = flush_ranks(engine.schedulers, self.engine.local_ranks, 0, busy)
        if busy:
            result.set_result([mine] + [dataclasses.replace(mine, node=k, ranks=hosts.local_ranks(k))
                                        for k in range(1, hosts.nnodes)])
            return
        flush_id = next(self._flush_ids)
        self._flushing[flush_id] = (result, {0: mine})
        self._outgoing.setdefault("flush", []).append(flush_id)

    def say_stop(self) -> None:
        """Node 0 leaving in order: the others read "stop" in the next exchange and end."""
        try:
            empty = [Proposal(0, False, False)] * self.hosts.dp
            self.hosts.exchange(empty, {"stop": True, "new": [], "abort": []})
            self.hosts.barrier("stopped", self.hosts.timeout_s)  # they have read it: the coordinator may go
        except PeerFailure:
            pass

    # ---- every node -----------------------------------------------------------------------------------
    def message(self) -> dict:
        """What this node tells the others this iteration."""
        if self.is_node_0:
            out, self._outgoing = self._outgoing, {"new": [], "abort": []}
            return out
        requests, updates = self.engine.requests, []
        flushed, self._flush_answers = self._flush_answers, []
        for rid, sent in list(self.origin.items()):
            req = requests.get(rid)
            if req is None:
                del self.origin[rid]
                continue
            update, self.origin[rid] = updates_mod.report(req, sent)
            if update is not None:
                updates.append(update)
            if req.finished:
                del self.origin[rid]
                del requests[rid]
        msg = {"updates": updates, "flushed": flushed} if flushed else {"updates": updates}
        now = time.perf_counter()
        if now - self._states_sent >= STATES_EVERY_S:
            msg["states"] = {r: self.engine.schedulers[r].state() for r in self.engine.local_ranks}
            self._states_sent = now
        return msg

    def receive(self, messages: list[dict]) -> None:
        """Apply the other nodes' messages of this iteration."""
        if not self.is_node_0:
            self._receive_from_node_0(messages[0])
            return
        now = time.perf_counter()
        for msg in messages[1:]:
            self.remote_state.update(msg.get("states", {}))
            for flush_id, answer in msg.get("flushed", ()):
                self._flush_answered(flush_id, answer)
            updates_mod.apply(self.engine.requests, msg.get("updates", ()), now)

    def _receive_from_node_0(self, msg: dict) -> None:
        if msg.get("stop"):
            self.node_0_stopped = True
            raise PeerStopped("node 0 shut down; this node ends too")
        engine = self.engine
        for flush_id in msg.get("flush", ()):  # before this message's new requests, which came after it
            busy = any(engine.schedulers[r].running or engine.schedulers[r].waiting for r in engine.local_ranks)
            answer = flush_ranks(engine.schedulers, engine.local_ranks, self.hosts.node_rank, busy)
            self._flush_answers.append((flush_id, answer))
        for fields in msg.get("new", ()):
            if fields[3] not in engine.local_ranks:
                continue
            req = updates_mod.received(fields, engine.tokenizer)
            self.origin[req.rid] = 0
            engine.submit(req)
        for rid in msg.get("abort", ()):
            if rid in self.origin:
                engine.abort(rid)

    def _flush_answered(self, flush_id: int, answer: NodeFlush) -> None:
        if flush_id not in self._flushing:
            return
        result, answers = self._flushing[flush_id]
        answers[answer.node] = answer
        if answer.node != 0:  # its ranks' figures after the flush, before /flush_cache answers
            self.remote_state.update(answer.states)
        if len(answers) == self.hosts.nnodes:
            del self._flushing[flush_id]
            result.set_result([answers[k] for k in sorted(answers)])

    def suspects(self) -> str:
        """Which node a failed step across the nodes lost: the one whose connection dropped, else the only
        other node, else "another node"."""
        gone = self.hosts.lost_nodes() or ([1 - self.hosts.node_rank] if self.hosts.nnodes == 2 else [])
        return " and ".join(f"node {k}" for k in gone) or "another node"

    def start_watchdog(self) -> None:
        start_thread(self._watchdog, "jaxdp-watchdog")

    def _watchdog(self) -> None:
        """A wait on another node that outlives the timeout (a stalled node, a collective that never ends)
        fails the engine, although the loop thread itself stays stuck in that wait."""
        engine, hosts, timeout = self.engine, self.hosts, self.hosts.timeout_s
        others = [f"node {k}" for k in range(hosts.nnodes) if k != hosts.node_rank]
        who = others[0] if len(others) == 1 else "one of " + ", ".join(others)
        while not engine.failed and engine.is_running:
            blocked = engine.blocked
            if blocked is not None and time.perf_counter() - blocked[0] > timeout:
                engine.fail(f"no answer from {who} for {timeout:.0f} s while {blocked[1]}; it died or stalled")
                return
            time.sleep(0.2)


@dataclasses.dataclass(frozen=True)
class NodeFlush:
    """What a prefix-cache flush did on one node's ranks."""

    node: int
    ranks: range
    flushed: bool
    freed_tokens: int = 0  # cached tokens whose pages went back to the pools
    reason: str | None = None  # why not flushed
    states: dict = dataclasses.field(default_factory=dict)  # its ranks' figures right after (node 0 shows them)

    def describe(self) -> str:
        where = f"node {self.node} (rank{'s' if len(self.ranks) > 1 else ''} {_span(self.ranks)})"
        if self.flushed:
            return f"{where}: flushed, {self.freed_tokens} cached tokens freed"
        return f"{where}: not flushed, {self.reason}"


def _span(ranks: range) -> str:
    return f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)


def flush_ranks(schedulers: list[Scheduler], ranks: range, node: int, busy: bool) -> NodeFlush:
    """Flush the prefix cache of these ranks unless requests run or wait (SGLang's /flush_cache rule)."""
    if busy:
        return NodeFlush(node, ranks, False, reason="requests are running or waiting")
    before = sum(schedulers[r].pool.free for r in ranks)
    ok = all([schedulers[r].cache.flush() for r in ranks])  # a list: every rank flushes, even after a False
    freed = sum(schedulers[r].pool.free for r in ranks) - before
    page = schedulers[ranks.start].pool.page_size
    return NodeFlush(node, ranks, ok, freed * page, None if ok else "some cached pages are still in use",
                     {r: schedulers[r].state() for r in ranks})
