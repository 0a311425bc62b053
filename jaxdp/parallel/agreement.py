"""Place 3 of `jaxdp.parallel.places`, the agreement: before each step, on the host, every rank's proposal is
exchanged and every rank reaches the same decision from the same numbers (rows and requests per rank, the
decode-bucket vote (AND), "any rank reads a prompt" (OR), who runs an idle batch). JAX-free: the schedulers
and the step pipeline import it, and nothing here touches a device.
"""

from __future__ import annotations

import dataclasses
import functools
import operator


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What one rank's scheduler would run next."""

    rows: int  # token rows of its batch (0: nothing to do)
    is_extend: bool  # it reads a prompt (chunk)
    decode_bucket_ok: bool  # its decode batch fits a compiled decode bucket
    pages: int = 0  # the most pages one of its sequences holds in this step (the page table's width)
    top: bool = False  # a request of its asks for top logprobs (computed over every node's logits, so together)
    prompt_logprobs: bool = False  # a prompt it reads asks for its logprobs (the step returns every row's logits)
    requests: int = 0  # the requests (sequences) of its batch: a speculative step's request slots
    held: int = 0  # speculative decoding: the requests the rank holds, running or waiting
    drafting: bool = False  # ... one of them drafts or would (it speculates)
    controls: int = 0  # bits: 1 a request of its has a logit bias or penalties, 2 a grammar (the sampler's variant)
    tbo: int = 0  # two-batch overlap (jaxdp.parallel.tbo_split.split_bits): 1 its batch splits as a decode step,
    # 2 as an extend step (a decode batch can run as one-token extends beside another rank's prompt)


@dataclasses.dataclass(frozen=True)
class Agreement:
    rows_per_rank: tuple[int, ...]
    any_extend: bool  # OR over ranks
    use_decode_bucket: bool  # AND over ranks
    idle_ranks: tuple[int, ...]  # ranks that run an idle batch
    run: bool  # False when every rank is idle: no step at all
    max_pages: int = 0  # MAX over ranks of their pages per sequence
    any_top: bool = False  # OR over ranks: the step computes the top logprobs
    any_prompt_logprobs: bool = False  # OR over ranks: the extend step returns the logits of every row
    requests_per_rank: tuple[int, ...] = ()  # each rank's requests (a speculative step's slots: MAX over ranks)
    held: int = 0  # SUM over ranks: the requests held (speculation's switch: jaxdp.engine.step.spec)
    any_drafting: bool = False  # OR over ranks: a request drafts or would
    controls: int = 0  # OR over ranks of their control bits: which sampler variant the step runs
    tbo: bool = False  # AND over the ranks with rows (of the bit of the step's kind): the step runs as two
    # micro-batches (an idle rank always can)

    @property
    def max_requests(self) -> int:
        return max(self.requests_per_rank, default=0)


class LocalExchange:
    """How ranks learn each other's proposals. On one host every rank's scheduler lives in this process,
    so the exchange is the list itself. Across hosts `jaxdp.engine.nodes.hosts.HostExchange` posts this node's
    ranks' proposals (and a small message riding along) to the distributed runtime and reads the other
    nodes', behind the same method; the schedulers do not change."""

    def exchange(self, proposals: list[Proposal], message: dict) -> tuple[list[Proposal], list[dict]]:
        return list(proposals), [message]


def agree_on_step(proposals: list[Proposal]) -> Agreement:
    """Every rank computes this from the same numbers and so reaches the same decision."""
    rows = tuple(p.rows for p in proposals)
    run = any(r > 0 for r in rows)
    any_extend = any(p.is_extend for p in proposals)
    busy = [p for p in proposals if p.rows > 0]
    use_decode = run and not any_extend and all(p.decode_bucket_ok for p in busy)
    idle = tuple(i for i, r in enumerate(rows) if r == 0) if run else ()
    return Agreement(rows, any_extend, use_decode, idle, run, max(p.pages for p in proposals),
                     any(p.top for p in busy), any(p.prompt_logprobs for p in busy),
                     tuple(p.requests for p in proposals),
                     sum(p.held for p in proposals), any(p.drafting for p in proposals),
                     functools.reduce(operator.or_, (p.controls for p in busy), 0),
                     run and all(p.tbo & (1 if use_decode else 2) for p in busy))
