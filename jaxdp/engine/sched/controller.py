"""The DP controller: which rank a new request goes to, and the one ledger of the load it has assigned.

round_robin (the default, as SGLang's) deals requests out in turn without looking at them;
total_tokens sends a request to the rank holding the fewest tokens (weighed against its pool: an unequal
small replica gets a share in proportion to what it holds); total_requests to the one with the fewest
requests. A request may pin its rank (`routed_dp_rank`, or the X-Data-Parallel-Rank header).

The ledger holds every request from the moment it is assigned (so a burst spreads out before the loop has
admitted any) until it finishes or is discarded; one made but never submitted (a client gone before its
stream began) stops counting, and its rid is free again, `UNSUBMITTED_S` after it was made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from jaxdp.engine.sched.request import BadRequest, Request

METHODS = ("round_robin", "total_tokens", "total_requests")
UNSUBMITTED_S = 30.0


class Controller:
    def __init__(self, num_ranks: int, method: str = "round_robin", capacity: Sequence[int] | None = None):
        """capacity: tokens each rank's KV pool holds (what total_tokens weighs a rank's tokens against)."""
        if method not in METHODS:
            raise ValueError(f"--load-balance-method {method!r} is not one of {', '.join(METHODS)}")
        self.num_ranks = num_ranks
        self.method = method
        self.capacity = list(capacity) if capacity is not None else [1] * num_ranks
        self._next = 0
        self._live: dict[str, tuple[int, Request]] = {}  # rid -> (rank, request): the pending-load ledger
        self._lock = threading.Lock()  # requests are made on the server's threads, the loop finishes them

    def check_rid(self, rid: str) -> None:
        if self.rank_of(rid) is not None:
            raise BadRequest(f"a request with rid {rid!r} is already running; use a unique rid")

    def check_pin(self, pinned) -> int:
        if isinstance(pinned, bool) or not isinstance(pinned, int):
            raise BadRequest(f"routed_dp_rank must be an integer, got {pinned!r}")
        if not 0 <= pinned < self.num_ranks:
            raise BadRequest(f"routed_dp_rank {pinned!r} is out of range; this server has DP ranks "
                             f"0..{self.num_ranks - 1}")
        return pinned

    def choose(self, pinned: int | None = None) -> int:
        """The rank for a new request: `pinned`, or the method's choice over the ledger's loads."""
        if pinned is not None:
            return self.check_pin(pinned)
        with self._lock:
            if self.method == "round_robin":
                rank, self._next = self._next, (self._next + 1) % self.num_ranks
                return rank
            key = 0 if self.method == "total_tokens" else 1
            loads = self._loads()
            return min(range(self.num_ranks), key=lambda r: (loads[r][key], r))

    def add(self, req: Request, rank: int) -> None:
        """From now until it finishes, `req` counts as `rank`'s load."""
        with self._lock:
            self._live[req.rid] = (rank, req)

    def discard(self, rid: str) -> None:
        """Forget a request that was made but will not run."""
        with self._lock:
            self._live.pop(rid, None)

    def rank_of(self, rid: str) -> int | None:
        """The rank of a live request (None when there is none of that rid)."""
        with self._lock:
            entry = self._live.get(rid)
            if entry is not None and self._ended(entry[1], time.perf_counter()):
                del self._live[rid]
                return None
            return entry[0] if entry is not None else None

    def loads(self) -> list[tuple[float, int]]:
        """(tokens held / pool size, requests) per rank, over the requests assigned and not finished."""
        with self._lock:
            return self._loads()

    @staticmethod
    def _ended(req: Request, now: float) -> bool:
        return req.finished or (not req.submitted and now - req.created > UNSUBMITTED_S)

    def _loads(self) -> list[tuple[float, int]]:
        tokens, reqs, now = [0] * self.num_ranks, [0] * self.num_ranks, time.perf_counter()
        for rid, (rank, req) in list(self._live.items()):
            if self._ended(req, now):
                del self._live[rid]
                continue
            tokens[rank] += req.num_tokens
            reqs[rank] += 1
        return [(tokens[r] / self.capacity[r], reqs[r]) for r in range(self.num_ranks)]
