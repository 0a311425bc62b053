"""The DP controller: which rank a new request goes to.

round_robin (the default, as SGLang's) deals requests out in turn without looking at them;
total_tokens sends a request to the rank holding the fewest tokens; total_requests to the one with the
fewest requests. A request may pin its rank (`routed_dp_rank`, or the X-Data-Parallel-Rank header).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxdp.engine.request import BadRequest

METHODS = ("round_robin", "total_tokens", "total_requests")


class Controller:
    def __init__(self, num_ranks: int, method: str = "round_robin"):
        if method not in METHODS:
            raise ValueError(f"--load-balance-method {method!r} is not one of {', '.join(METHODS)}")
        self.num_ranks = num_ranks
        self.method = method
        self._next = 0

    def assign(self, loads: Sequence[tuple[int, int]] | None, pinned: int | None = None) -> int:
        """loads: (tokens, requests) per rank (needed unless pinned). Returns the rank for a new request."""
        if pinned is not None:
            if not isinstance(pinned, int) or not 0 <= pinned < self.num_ranks:
                raise BadRequest(f"routed_dp_rank {pinned!r} is out of range; this server has DP ranks "
                                 f"0..{self.num_ranks - 1}")
            return pinned
        if self.method == "round_robin":
            rank = self._next
            self._next = (self._next + 1) % self.num_ranks
            return rank
        key = 0 if self.method == "total_tokens" else 1
        return min(range(self.num_ranks), key=lambda r: (loads[r][key], r))
