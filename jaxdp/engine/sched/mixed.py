"""Mixed chunks (`--enable-mixed-chunk`): a rank that reads a prompt also carries its own decoding requests in
the same extend step, one token each after the prompt's pieces, so they get a token in that step instead of
waiting for the prompt.

A decoder keeps its row of the persistent batch: the step reads it as a decode step would (`rows.fill_decodes`:
its input token may still be on the device, a marker the step resolves), and commit and booking treat it as a
decode row. A one-token extend over a cache that holds everything but the last token computes what a decode
step computes (the relabeling the engine already does for the other ranks), so the tokens are the same as in
separate steps. The decoders' rows come out of the rank's prompt budget, so a mixed step is never larger than
a prompt chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxdp.engine.sched.pool import PagePool
    from jaxdp.engine.sched.rank_plan import RankPlan
    from jaxdp.engine.sched.rows import RankRows


def decoders_to_carry(rows: RankRows, chunk_size: int) -> np.ndarray:
    """The rows a mixed step would carry (none when they would leave no room for the prompt)."""
    carry = rows.decodable()
    return carry if len(carry) < chunk_size else carry[:0]


def add_decoders(plan: RankPlan, carry: np.ndarray, rows: RankRows, pool: PagePool, take_pages) -> None:
    """Append the decoders of rows `carry` to the extend `plan`. One whose next token starts a page takes it
    here, as a decode step's would; when none is free it stays out of this step (and decodes in a later one,
    where running short retracts as usual)."""
    keep = np.ones(len(carry), bool)
    for i in np.nonzero(rows.a.length[carry] > rows.a.num_pages[carry] * rows.page_size)[0]:
        req = rows.reqs[carry[i]]
        pages = take_pages(pool.pages_for(int(rows.a.length[carry[i]])) - len(req.pages))
        if pages is None:
            keep[i] = False
        else:
            rows.add_pages(req, pages)
    plan.rows = carry[keep]
    plan.reqs += [rows.reqs[i] for i in plan.rows]
