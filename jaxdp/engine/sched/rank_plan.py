"""A rank's plan for one step: what the scheduler decided and what booking needs (`RankPlan`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdp.batch import Piece
from jaxdp.engine.sched.request import Request
from jaxdp.parallel.agreement import Proposal


@dataclasses.dataclass
class RankPlan:
    """What a rank runs in one step and what booking it needs; the scheduler's own (the engine only reads it).

    `schedule` makes it (choosing requests and giving them pages), `commit` applies it once the step is
    queued (markers for the tokens in flight, prompt progress, requests that start decoding), `book` takes
    its tokens back. A plan that is never committed (its step failed) changes nothing but page ownership."""

    kind: str  # "extend" | "decode" | "verify" (speculative decoding: jaxdp.engine.step.spec)
    reqs: list[Request]  # those of the pieces, then those of the rows
    pieces: list[Piece] = dataclasses.field(default_factory=list)  # extend: one per prompt read
    rows: np.ndarray | None = None  # rows of the persistent batch that decode (in an extend: a mixed chunk's)
    step: int = -1  # set by commit
    sampled_rows: np.ndarray | None = None  # per request: its row if this step samples it, else -1 (commit)
    out_pos: np.ndarray | None = None  # per request: where its token goes in output_ids, -1: none (commit)
    ends: np.ndarray | None = None  # per request: its context length once this step's latents are written
    sampling: list[tuple] = dataclasses.field(default_factory=list)  # each piece's request's sampling row
    inits: list[Request] = dataclasses.field(default_factory=list)  # requests given a penalty slot by this plan: the
    # step fills their slot from their tokens before it samples (`jaxdp.engine.step.controls`)

    @property
    def num_rows(self) -> int:
        return sum(len(p.tokens) for p in self.pieces) + (0 if self.rows is None else len(self.rows))

    @property
    def num_sampled(self) -> int:
        return int((self.out_pos >= 0).sum()) if self.out_pos is not None else 0

    def subset(self, keep: list[int]) -> RankPlan | None:
        """The plan of requests `keep` only (an uncommitted plan; None if empty)."""
        if not keep:
            return None
        n = len(self.pieces)
        pieces, rows = [i for i in keep if i < n], [i - n for i in keep if i >= n]
        kind = self.kind if self.kind == "verify" else "extend" if pieces else "decode"  # (a verify's are pieces)
        kept = [self.reqs[i] for i in keep]
        return RankPlan(kind, kept, [self.pieces[i] for i in pieces],
                        self.rows[rows] if self.rows is not None else None,
                        sampling=[self.sampling[i] for i in pieces], inits=[r for r in self.inits if r in kept])

    def halves(self) -> list[RankPlan]:
        n = len(self.reqs)
        return [p for p in (self.subset(list(range(n // 2))), self.subset(list(range(n // 2, n)))) if p]

    def unfinished(self) -> RankPlan | None:
        return self.subset([i for i, r in enumerate(self.reqs) if not r.finished])


def rank_proposals(plans: list[RankPlan | None], largest_decode_bucket: int, num_pages_RB: np.ndarray,
                   top_R: list[bool] | None = None, largest_decode_requests: int | None = None,
                   controls_R: list[int] | None = None) -> list[Proposal]:
    """What each rank proposes for the agreement: its rows, "reads a prompt", "fits a decode bucket", the
    most pages one of its sequences holds (num_pages_RB: the persistent batch's pages per row), whether a
    request of it asks for top logprobs (top_R), whether a prompt it reads asks for prompt logprobs, and its
    requests (a speculative step's request slots are bucketed by them, apart from its rows; a speculative decode
    bucket holds largest_decode_requests of them, whatever their rows), and which sampling controls its requests
    use (controls_R: bits, `jaxdp.engine.step.controls`)."""
    fits = (lambda p: True) if largest_decode_requests is None else (lambda p: len(p.reqs) <= largest_decode_requests)
    return [Proposal(p.num_rows, p.kind == "extend", p.num_rows <= largest_decode_bucket and fits(p),
                     plan_pages(p, num_pages_RB[r]), bool(top_R and top_R[r]),
                     any(q.prompt_logprobs_left for q in p.reqs[: len(p.pieces)]), len(p.reqs),
                     controls=controls_R[r] if controls_R else 0)
            if p else Proposal(0, False, False)
            for r, p in enumerate(plans)]


def plan_pages(plan: RankPlan, num_pages_B: np.ndarray) -> int:
    pieces = max((len(p.pages) for p in plan.pieces), default=0)
    rows = int(num_pages_B[plan.rows].max()) if plan.rows is not None and len(plan.rows) else 0
    return max(pieces, rows)
