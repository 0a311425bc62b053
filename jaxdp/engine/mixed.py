"""Mixed chunks (`--enable-mixed-chunk`): a rank that reads a prompt also carries its own decoding requests in
the same extend step, one row each, so they get a token in that step instead of waiting for the prompt.

A one-token extend over a cache that holds everything but the last token computes what a decode step computes
(the relabeling the engine already does for the other ranks), so the tokens are the same as in separate steps.
The decoders' rows come out of the rank's prompt budget, so a mixed step is never larger than a prompt chunk.
"""

from __future__ import annotations

from jaxdp.batch import Piece
from jaxdp.engine.request import Request, State


def decoders_to_carry(running: list[Request], decodable, chunk_size: int) -> list[Request]:
    """The running requests a mixed step would carry (none when they would leave no room for the prompt)."""
    carry = [r for r in running if r.state == State.RUNNING and decodable(r)]
    return carry if len(carry) < chunk_size else []


def add_decoders(plan, decoders: list[Request], pool, take_pages) -> None:
    """Append one decode row per request in `decoders` to the extend `plan` (a RankPlan). A decoder that needs
    a new page when none is free stays out of this step; it decodes in a later one, as usual."""
    for req in decoders:
        need = pool.pages_for(req.num_tokens) - len(req.pages)
        if need > 0:
            pages = take_pages(need)
            if pages is None:
                continue
            req.pages += pages
        plan.reqs.append(req)
        plan.pieces.append(Piece([req.all_ids[-1]], req.num_tokens - 1, req.pages))
        plan.sample.append(True)
        req.computed = req.num_tokens
