"""An Engine's side of the other nodes (several nodes, see `jaxdp.engine.hosts`): what rides on the exchange.

Node 0 (HTTP, controller) keeps a stand-in `Request` for each request it sends to another node's rank; the
message it posts each iteration carries those new requests and their aborts. Every other node adds what it
receives to its own schedulers, and its message carries back, per request, the tokens booked since the last
one (and the finish), plus its ranks' states a few times a second. Node 0 applies them to the stand-ins, so
streaming, metrics and the controller see remote requests as local ones. `watchdog` bounds every wait on
another node that the exchange's own timeout does not cover (a step that never finishes).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING

from jaxdp.engine.hosts import HostExchange, PeerFailure, PeerStopped
from jaxdp.engine.request import Request, SamplingParams, State
from jaxdp.engine.setup import stop_string_check
from jaxdp.parallel.places import Proposal

if TYPE_CHECKING:
    from jaxdp.engine.engine import Engine

STATES_EVERY_S = 0.25  # rank states for /get_load and metrics: four times a second is enough


class NodeLink:
    def __init__(self, engine: Engine, hosts: HostExchange):
        self.engine, self.hosts = engine, hosts
        self.is_node_0 = hosts.node_rank == 0
        self.remote_state: dict[int, dict] = {}  # node 0: the other nodes' ranks' states
        self._outgoing: dict[str, list] = {"new": [], "abort": []}  # node 0: for other nodes' ranks
        self.origin: dict[str, int] = {}  # other nodes: node 0's requests here -> tokens reported back
        self._states_sent = 0.0
        self.node_0_stopped = False  # other nodes: node 0 said "stop" (an orderly end, not a failure)

    # ---- node 0 -------------------------------------------------------------------------------------
    def forward(self, req: Request) -> None:
        """A request for another node's rank: it goes out with the next message; the stand-in stays here."""
        self.engine.requests[req.rid] = req
        self._outgoing["new"].append((req.rid, req.prompt_ids, dataclasses.asdict(req.params), req.rank))

    def forward_abort(self, req: Request, now: float) -> None:
        """The owning node frees the pages; the stand-in ends now."""
        self._outgoing["abort"].append(req.rid)
        end_request(req, "abort", None, now)

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
        for rid, sent in list(self.origin.items()):
            req = requests.get(rid)
            if req is None:
                del self.origin[rid]
                continue
            ids = req.done_ids
            if len(ids) > sent or req.finished:
                lps = req.output_logprobs[sent:] if req.params.return_logprob else []
                updates.append((rid, ids[sent:], lps, req.cached_tokens,
                                req.finish_reason if req.finished else None, req.error))
                if req.finished:
                    del self.origin[rid]
                    del requests[rid]
                else:
                    self.origin[rid] = len(ids)
        msg = {"updates": updates}
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
            for rid, ids, lps, cached, finish, error in msg.get("updates", ()):
                req = self.engine.requests.get(rid)
                if req is None or req.finished:
                    continue
                req.output_ids.extend(ids)
                req.output_logprobs.extend(lps)
                req.cached_tokens = cached
                if ids and req.first_token_at is None:
                    req.first_token_at = now
                if finish:
                    end_request(req, finish, error, now)
                else:
                    req.state = State.RUNNING
                    if ids and req.on_update:
                        req.on_update(req)

    def _receive_from_node_0(self, msg: dict) -> None:
        if msg.get("stop"):
            self.node_0_stopped = True
            raise PeerStopped("node 0 shut down; this node ends too")
        engine = self.engine
        for rid, prompt_ids, params, rank in msg.get("new", ()):
            if rank not in engine.local_ranks:
                continue
            req = Request(rid, prompt_ids, SamplingParams(**params), rank=rank)
            if req.params.stop and engine.tokenizer is not None:
                req.stop_check = stop_string_check(engine.tokenizer, req.params.stop)
            self.origin[rid] = 0
            engine.submit(req)
        for rid in msg.get("abort", ()):
            if rid in self.origin:
                engine.abort(rid)

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watchdog, name="jaxdp-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        """A wait on another node that outlives the timeout (a stalled node, a collective that never ends)
        fails the engine, although the loop thread itself stays stuck in that wait."""
        engine, timeout = self.engine, self.hosts.timeout_s
        while not engine.failed and engine.is_running:
            blocked = engine.blocked
            if blocked is not None and time.perf_counter() - blocked[0] > timeout:
                engine.fail(f"no answer from the other nodes for {timeout:.0f} s while {blocked[1]}; a node "
                            "died or stalled")
                return
            time.sleep(0.2)


def end_request(req: Request, reason: str, error: str | None, now: float) -> None:
    """End a request outside a scheduler (a stand-in for another node's, or on failure)."""
    req.output_ids = list(req.done_ids)
    req.finish_reason, req.error = reason, error if error is not None else req.error
    req.state, req.finished_at = State.FINISHED, now
    if req.on_update:
        req.on_update(req)
