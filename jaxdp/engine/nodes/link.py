"""An engine's side of the other nodes: the one interface (`Nodes`) its loop and step pipeline talk to, so that
neither has a branch for several nodes. `OneNode` is the single-node case (every rank is here, the exchange is
the list itself); `NodeLink` is the case of several (see `jaxdp.engine.nodes.hosts`): what rides on the exchange.

Node 0 (HTTP, controller) keeps a stand-in `Request` for each request it sends to another node's rank; the
message it posts each iteration carries those new requests and their aborts. Every other node adds what it
receives to its own schedulers, and its message carries back, per request, the tokens booked since the last
one (and the finish), plus its ranks' states a few times a second. Node 0 applies them to the stand-ins, so
streaming, metrics and the controller see remote requests as local ones. An admin command (a prefix-cache
flush) rides the same way: node 0 sends it, every node carries it out on its own ranks and answers, and
node 0 answers the HTTP request once every node has (`NodeFlush`, one per node). The expert-distribution
recorder's actions (start, stop, dump) ride in node 0's message too, and every node, node 0 included, carries them
out right after the exchange that delivered them, before the step that exchange agreed on: the recording is part
of the compiled step that every process runs, so every node starts, stops and gathers between the same two steps
(a dump's gather is itself a program over every process). `watchdog` bounds every
wait on another node that the exchange's own timeout does not cover (a step that never finishes).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

from jaxdp.engine.ipc import updates as updates_mod
from jaxdp.engine.ipc.messages import NodeFlush, NodeMessage
from jaxdp.engine.nodes.hosts import HostExchange, PeerFailure, PeerStopped, first_line
from jaxdp.engine.sched.request import Request
from jaxdp.engine.sched.scheduler import Scheduler
from jaxdp.engine.threads import start_thread
from jaxdp.eplb.distribution import RecordOutcome
from jaxdp.parallel.agreement import Proposal

__all__ = ["NodeFlush", "NodeLink", "Nodes", "OneNode", "flush_ranks"]

STATES_EVERY_S = 0.25  # rank states for /get_load and metrics: four times a second is enough


class EngineSide(Protocol):
    """What the nodes interface uses of its engine (`jaxdp.Engine`), so that this module need not import it."""

    requests: dict[str, Request]
    schedulers: list[Scheduler]
    tokenizer: Any
    failed: str | None
    blocked: tuple[float, str] | None
    disagg: Any  # prefill/decode disaggregation's side (`jaxdp.engine.step.pd_sides`), or None

    @property
    def is_running(self) -> bool: ...

    def submit(self, req: Request) -> Request: ...

    def abort(self, rid: str) -> None: ...

    def fail(self, message: str) -> None: ...

    def record_experts(self, action: str) -> RecordOutcome:
        """Carry out an expert-distribution recorder action on this node's runner now (`jaxdp.eplb.recorder`)."""


class Nodes(Protocol):
    """The other nodes as an engine sees them (none: `OneNode`)."""

    local_ranks: range  # the ranks this node schedules
    waits_for_requests: bool  # an idle loop waits for a request (else it waits inside the next exchange)
    bisects_failures: bool  # a failed step is retried in parts to find its request (not across nodes)

    def message(self) -> NodeMessage:
        """What this node tells the others this iteration."""

    def exchange(self, proposals: list[Proposal], message: NodeMessage) -> tuple[list[Proposal], list[NodeMessage]]:
        """Every rank's proposal and every node's message of this iteration."""

    def receive(self, messages: list[NodeMessage]) -> None:
        """Apply the other nodes' messages of this iteration."""

    def send_away(self, req: Request) -> bool:
        """Node 0: send a request for another node's rank there (True), or leave it to this node (False)."""

    def abort_away(self, rid: str, now: float) -> bool:
        """Abort a request another node runs (True), or leave it to this node (False)."""

    def requests_elsewhere(self) -> list[Request]:
        """Node 0: its stand-ins of the requests that other nodes run."""

    def flush(self, result: Any, busy: bool) -> None:
        """/flush_cache on every node's ranks; `result.set_result` gets one NodeFlush per node."""

    def expert_record(self, action: str, result: Any) -> None:
        """An expert-distribution recorder action on every node, between the same two steps; `result.set_result`
        gets the RecordOutcome (a dump: every device's counts)."""

    def rank_state(self, rank: int) -> dict | None:
        """Another node's rank's figures as of the last exchange (None: a rank of this node)."""

    def keep(self) -> dict[str, int]:
        """Finished requests still to be reported to node 0 (the engine does not forget them yet)."""

    def start(self, start_loop: Callable[[], None]) -> None:
        """Start the engine's loop: after meeting the other nodes, and watching every wait on them."""

    def step_failed(self, e: Exception) -> str | None:
        """What a failed step means for the engine: a message to fail it with, or None (this node's own)."""

    def stop(self) -> None:
        """The loop ends in order: tell the others (node 0)."""


class OneNode:
    """Every rank on this node: the exchange is the list itself, nothing rides on it, nobody to tell."""

    waits_for_requests = True
    bisects_failures = True

    def __init__(self, engine: EngineSide, dp: int):
        self.engine, self.local_ranks = engine, range(dp)

    def message(self) -> NodeMessage:
        return NodeMessage()

    def exchange(self, proposals: list[Proposal], message: NodeMessage) -> tuple[list[Proposal], list[NodeMessage]]:
        return list(proposals), [message]

    def receive(self, messages: list[NodeMessage]) -> None:
        pass

    def send_away(self, req: Request) -> bool:
        return False

    def abort_away(self, rid: str, now: float) -> bool:
        return False

    def requests_elsewhere(self) -> list[Request]:
        return []

    def flush(self, result: Any, busy: bool) -> None:
        result.set_result([flush_ranks(self.engine.schedulers, self.local_ranks, 0, busy)])

    def expert_record(self, action: str, result: Any) -> None:
        result.set_result(self.engine.record_experts(action))

    def rank_state(self, rank: int) -> dict | None:
        return None

    def keep(self) -> dict[str, int]:
        return {}

    def start(self, start_loop: Callable[[], None]) -> None:
        start_loop()

    def step_failed(self, e: Exception) -> str | None:
        return None

    def stop(self) -> None:
        pass


class NodeLink:
    """The other nodes of a model world that spans several (`hosts`: the exchange with them)."""

    bisects_failures = False  # a step across the nodes: every node must run it; a failure fails the engine

    def __init__(self, engine: EngineSide, hosts: HostExchange):
        self.engine, self.hosts = engine, hosts
        self.local_ranks = hosts.local_ranks()
        self.is_node_0 = self.waits_for_requests = hosts.node_rank == 0  # (other nodes wait for node 0's message)
        self.remote_state: dict[int, dict] = {}  # node 0: the other nodes' ranks' states
        self.standins: dict[str, Request] = {}  # node 0: the requests other nodes run, kept up to date here
        self._outgoing = NodeMessage()  # node 0: for other nodes' ranks
        self.origin: dict[str, int] = {}  # other nodes: node 0's requests here -> tokens reported back
        self._states_sent = 0.0
        self.node_0_stopped = False  # other nodes: node 0 said "stop" (an orderly end, not a failure)
        self._flush_ids = itertools.count(1)
        self._flushing: dict[int, tuple[Any, dict[int, NodeFlush]]] = {}  # node 0: id -> (result, answers)
        self._flush_answers: list[tuple[int, NodeFlush]] = []  # other nodes: answers for the next message
        self._record_results: list[Any] = []  # node 0: the results of the recorder actions in `_outgoing`
        self._recorded: list[Any] = []  # node 0: those of the message just sent, answered once it is delivered

    # ---- node 0 -------------------------------------------------------------------------------------
    def send_away(self, req: Request) -> bool:
        """A request for another node's rank: it goes out with the next message; the stand-in stays here."""
        if req.rank in self.local_ranks:
            return False
        self.standins[req.rid] = req
        self._outgoing.new.append(updates_mod.sent(req))
        return True

    def abort_away(self, rid: str, now: float) -> bool:
        """The owning node frees the pages; the stand-in ends now."""
        req = self.standins.pop(rid, None)
        if req is None:
            return False
        if not req.finished:
            self._outgoing.abort.append(rid)
            updates_mod.end(req, "abort", None, now)
        return True

    def requests_elsewhere(self) -> list[Request]:
        return list(self.standins.values())

    def flush(self, result: Any, busy: bool) -> None:
        """/flush_cache on every node: node 0 flushes its ranks now and asks the others in the next message;
        `result.set_result` gets one NodeFlush per node once all have answered. Every request comes through
        node 0, so node 0 knows whether any runs anywhere: then no node flushes (as SGLang)."""
        hosts, engine = self.hosts, self.engine
        if engine.failed:  # the other nodes will not answer
            result.set_result(None)
            return
        busy = busy or any(not r.finished for r in self.standins.values())
        mine = flush_ranks(engine.schedulers, self.local_ranks, 0, busy)
        if busy:
            result.set_result([mine] + [dataclasses.replace(mine, node=k, ranks=hosts.local_ranks(k))
                                        for k in range(1, hosts.nnodes)])
            return
        flush_id = next(self._flush_ids)
        self._flushing[flush_id] = (result, {0: mine})
        self._outgoing.flush.append(flush_id)

    def expert_record(self, action: str, result: Any) -> None:
        """Node 0: the action goes out with the next message, and every node (this one too) carries it out after
        that exchange; the result is this node's outcome (every node's is the same: they hold the same program's
        arrays). Another node has no HTTP server; an action asked of it there is refused."""
        if not self.is_node_0:
            result.set_result(RecordOutcome(error="the expert-distribution recorder's actions go to node 0, whose "
                                                  "server carries them to every node."))
            return
        self._outgoing.experts.append(action)
        self._record_results.append(result)

    def rank_state(self, rank: int) -> dict | None:
        if rank in self.local_ranks:
            return None
        return self.remote_state.get(rank) or self.engine.schedulers[rank].state()

    def stop(self) -> None:
        """Node 0 leaving in order: the others read "stop" in the next exchange and end."""
        if not self.is_node_0:
            return
        try:
            empty = [Proposal(0, False, False)] * self.hosts.dp
            self.hosts.exchange(empty, NodeMessage(stop=True))
            self.hosts.barrier("stopped", self.hosts.timeout_s)  # they have read it: the coordinator may go
        except PeerFailure:
            pass

    # ---- every node -----------------------------------------------------------------------------------
    def exchange(self, proposals: list[Proposal], message: NodeMessage) -> tuple[list[Proposal], list[NodeMessage]]:
        return self.hosts.exchange(proposals, message)

    def message(self) -> NodeMessage:
        """What this node tells the others this iteration."""
        if self.is_node_0:
            out, self._outgoing = self._outgoing, NodeMessage()
            self._recorded, self._record_results = self._record_results, []
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
            if req.finished:  # (the engine forgets it once it is not in `keep`)
                del self.origin[rid]
        msg = NodeMessage(updates=updates, flushed=flushed)
        if self.engine.disagg is not None:  # a prefill server's rooms, for node 0's bootstrap endpoint
            msg.rooms = self.engine.disagg.rooms_out()
        now = time.perf_counter()
        if now - self._states_sent >= STATES_EVERY_S:
            msg.states = {r: self.engine.schedulers[r].state() for r in self.local_ranks}
            self._states_sent = now
        return msg

    def receive(self, messages: list[NodeMessage]) -> None:
        """Apply the other nodes' messages of this iteration."""
        if not self.is_node_0:
            self._receive_from_node_0(messages[0])
            return
        recorded, self._recorded = self._recorded, []
        for action, result in zip(messages[0].experts, recorded, strict=True):  # (node 0's own message)
            result.set_result(self.engine.record_experts(action))
        now = time.perf_counter()
        for msg in messages[1:]:
            self.remote_state.update(msg.states or {})
            for flush_id, answer in msg.flushed:
                self._flush_answered(flush_id, answer)
            if msg.rooms:
                self.engine.disagg.rooms_in(msg.rooms)
            updates_mod.apply(self.standins, msg.updates, now)
            for u in msg.updates:
                if u.finish:
                    self.standins.pop(u.rid, None)

    def _receive_from_node_0(self, msg: NodeMessage) -> None:
        if msg.stop:
            self.node_0_stopped = True
            raise PeerStopped("node 0 shut down; this node ends too")
        engine = self.engine
        for action in msg.experts:  # as node 0 does, between the same two steps (node 0 reads the outcome)
            engine.record_experts(action)
        for flush_id in msg.flush:  # before this message's new requests, which came after it
            busy = any(engine.schedulers[r].running or engine.schedulers[r].waiting for r in self.local_ranks)
            answer = flush_ranks(engine.schedulers, self.local_ranks, self.hosts.node_rank, busy)
            self._flush_answers.append((flush_id, answer))
        for sent in msg.new:
            if sent.rank not in self.local_ranks:
                continue
            req = updates_mod.received(sent, engine.tokenizer)
            self.origin[req.rid] = 0
            engine.submit(req)
        for rid in msg.abort:
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

    def keep(self) -> dict[str, int]:
        return self.origin

    def step_failed(self, e: Exception) -> str:
        """A collective with a dead node fails here: which node a failed step across the nodes lost: the one
        whose connection dropped, else the only other node, else "another node"."""
        gone = self.hosts.lost_nodes() or ([1 - self.hosts.node_rank] if self.hosts.nnodes == 2 else [])
        who = " and ".join(f"node {k}" for k in gone) or "another node"
        return f"a step across the nodes failed ({first_line(e, 120)}); {who} died"

    def start(self, start_loop: Callable[[], None]) -> None:
        """Nodes finish compiling at different times: meet before the first step; then watch the waits."""
        self.hosts.barrier("ready", self.hosts.init_timeout_s)
        start_loop()
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
