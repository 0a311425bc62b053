"""The serving backend the app talks to: one Engine (its attention-DP ranks), or R replicas (`--dp-size R`),
each an Engine on its own contiguous sub-mesh with its own pools and schedulers, behind one controller.

Ranks are numbered globally (replica r's local rank j is rank offset_r + j), which is what
`routed_dp_rank`, /get_load and the metrics' `dp_rank` label mean. The server has one controller, here, over
all ranks, and its ledger is the only record of the load assigned (see `jaxdp.engine.sched.controller`); the
engines get their ranks pinned. `total_tokens` weighs each rank's tokens against its pool: an
unequal small replica (the guide's two-L4 story) gets a share of the work in proportion to what it can
hold, instead of half of it (round_robin) or a queue it cannot drain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable

from jaxdp.engine import Request, SamplingParams
from jaxdp.engine.ipc.client import EngineClient, prefill_rank
from jaxdp.engine.nodes.link import NodeFlush
from jaxdp.engine.sched.controller import Controller
from jaxdp.engine.sched.request import Bootstrap


@dataclasses.dataclass
class RankCounters:
    """Per-rank figures the API layer adds up (read and reset by the log poller)."""

    new_seqs: int = 0
    new_tokens: int = 0
    cached_tokens: int = 0


class ReplicaSet:
    """Same interface for the app whether it serves one engine or several replicas (each an EngineClient: an
    Engine here, or the stand-in of one in the engine process)."""

    def __init__(self, engines: list[EngineClient], method: str = "round_robin"):
        if not engines:
            raise ValueError("a ReplicaSet needs at least one engine")
        self.engines = engines
        self.ranks: list[tuple[EngineClient, int]] = [(e, j) for e in engines for j in range(e.layout.dp)]
        self.controller = Controller(len(self.ranks), method, [self.capacity(r) for r in range(len(self.ranks))])
        self.method = method
        self._lock = threading.Lock()
        self.counters = [RankCounters() for _ in self.ranks]
        # (rank, seconds since the last update, new tokens, first update of the request)
        self.on_token: list[Callable[[int, float, int, bool], None]] = []
        self.on_finish: list[Callable[[int, Request], None]] = []  # finished, or abandoned by its client
        self._rids = 0

    # ---- facts about the ranks ---------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_replicas(self) -> int:
        return len(self.engines)

    @property
    def tokenizer(self):
        return self.engines[0].tokenizer

    @property
    def model_cfg(self):
        return self.engines[0].model_cfg

    def capacity(self, rank: int) -> int:
        """Tokens the rank's KV pool holds (every rank of an engine has the same pool)."""
        facts = self.ranks[rank][0].facts
        return facts.num_pages * facts.page_size

    def context_len(self, rank: int | None = None) -> int:
        if rank is None:
            return max(e.context_len for e in self.engines)
        return self.ranks[rank][0].context_len

    def replica_of(self, rank: int) -> int:
        return self.engines.index(self.ranks[rank][0])

    # ---- requests ----------------------------------------------------------------------------------
    def loads(self) -> list[tuple[float, int]]:
        """(tokens held / pool size, requests) per rank, counting requests not yet admitted by the loop."""
        return self.controller.loads()

    def make_request(self, prompt_ids: list[int], params: SamplingParams, *, rid: str | None = None,
                     rank: int | None = None, bootstrap: Bootstrap | None = None) -> Request:
        """A request assigned to a global rank (chosen, or pinned by `rank`); BadRequest when it cannot run."""
        with self._lock:
            self._rids += 1
            rid = rid or f"req-{self._rids}-{time.time_ns() % 10**9}"
        self.controller.check_rid(rid)
        if bootstrap is not None and rank is None:
            disagg = self.engines[0].cfg.disaggregation
            if disagg is not None and disagg.mode == "prefill":  # the room names the rank, over every replica's
                rank = prefill_rank(bootstrap, len(self.ranks))
        g = self.controller.choose(rank)
        engine, local = self.ranks[g]
        req = engine.make_request(prompt_ids, params, rid=rid, rank=local, bootstrap=bootstrap)
        req.dp_rank = g  # the global rank, for meta_info and metrics
        self.controller.add(req, g)
        return req

    async def stream(self, req: Request) -> AsyncIterator[Request]:
        """The engine's stream, plus the controller's bookkeeping and the per-token observers."""
        g = req.dp_rank
        engine = self.ranks[g][0]
        last, seen = time.perf_counter(), 0
        try:
            async with contextlib.aclosing(engine.stream(req)) as updates:
                async for r in updates:
                    now, n = time.perf_counter(), len(r.done_ids)
                    if seen == 0 and n > 0:
                        with self._lock:
                            c = self.counters[g]
                            c.new_seqs += 1
                            c.cached_tokens += r.cached_tokens
                            c.new_tokens += len(r.prompt_ids) - r.cached_tokens
                    if n > seen:
                        for cb in self.on_token:
                            cb(g, now - last, n - seen, seen == 0)
                        last, seen = now, n
                    yield r
        finally:
            for cb in self.on_finish:  # an unfinished request here is one whose client went away
                cb(g, req)

    def take_counters(self, rank: int) -> RankCounters:
        """The rank's prefill counters since the last call (the log poller's)."""
        with self._lock:
            c, self.counters[rank] = self.counters[rank], RankCounters()
        return c

    def discard(self, req: Request) -> None:
        """Forget a request that was made but will not be streamed (a later one of its batch was refused)."""
        self.controller.discard(req.rid)

    def abort(self, rid: str) -> None:
        rank = self.controller.rank_of(rid)
        if rank is not None:
            self.ranks[rank][0].abort(rid)

    async def generate(self, req: Request) -> Request:
        async for _ in self.stream(req):
            pass
        return req

    # ---- the loops ---------------------------------------------------------------------------------
    def start(self) -> None:
        for e in self.engines:
            e.start()

    def alive(self) -> bool:
        return all(e.is_running for e in self.engines)

    def flush_cache(self) -> list[tuple[int, NodeFlush]] | None:
        """Every replica's flush, per node: (replica, what that node did); None if a node did not answer."""
        out, offset = [], 0
        for i, e in enumerate(self.engines):
            reports = e.flush_cache()
            if reports is None:
                return None
            out += [(i, dataclasses.replace(r, ranks=range(offset + r.ranks.start, offset + r.ranks.stop)))
                    for r in reports]
            offset += e.layout.dp
        return out

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()

    # ---- state, for /get_load, /get_server_info, metrics and logs ---------------------------------
    def rank_state(self, rank: int, loads: list[tuple[float, int]] | None = None) -> dict:
        engine, local = self.ranks[rank]
        loads = loads or self.loads()
        return {"dp_rank": rank, "replica": self.replica_of(rank),
                **engine.rank_state(local),  # (Scheduler.state retries a read the loop disturbs)
                "context_length": engine.context_len,
                "controller_load": loads[rank][0]}  # what total_tokens compares: tokens / pool

    def states(self) -> list[dict]:
        loads = self.loads()
        return [self.rank_state(r, loads) for r in range(self.num_ranks)]

