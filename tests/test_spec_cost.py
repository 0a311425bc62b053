"""What a speculative step costs, counted in XLA's FLOPs of the compiled step (independent of the machine's load):
a speculative prompt step's request slots follow the requests of the step (the agreement's requests per rank),
not --max-running-requests."""


import pytest

from jaxdp.engine.step.buckets import Buckets
from jaxdp.parallel.agreement import Proposal, agree_on_step
from jaxdp.parallel.step import StepShape
from tests.test_spec_decode import rigged, runner_for

D = 3  # SGLang's DeepSeek default: 3 steps, 4 draft tokens
PAGES = 8


@pytest.fixture(scope="module", autouse=True)
def xla_products():
    """XLA's FLOP count does not see inside a custom call: the steps here are counted on XLA's own products
    (`jaxdp.native` off), whose work is what the count can compare."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXDP_NATIVE", "0")
        yield


@pytest.fixture(scope="module")
def runner(xla_products):
    return runner_for(rigged(), "dp=2")


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def proposals(rows: list[int], requests: list[int], extend: bool) -> list[Proposal]:
    return [Proposal(n, extend and n > 0, not extend, PAGES if n else 0, requests=q)
            for n, q in zip(rows, requests, strict=True)]


def test_a_speculative_prompt_step_does_not_grow_with_max_running_requests(runner):
    """One prompt chunk of 64 rows on rank 0 (rank 1 idle): the same compiled step, and the same FLOPs, whether
    the server holds 16 or 64 requests a rank; padded to 64 request slots (min(rows, requests a rank), as before)
    the step costs far more."""
    agreement = agree_on_step(proposals([64, 0], [1, 0], extend=True))
    assert agreement.requests_per_rank == (1, 0) and agreement.max_requests == 1
    shapes, costs = [], []
    for max_running in (16, 64):
        b = Buckets.make(max_running, 64, 2, draft_tokens=D).with_pages(PAGES, 8)
        shape = b.shape_for([64, 0], agreement)
        assert shape in b.shapes() and (shape.num_rows, shape.num_requests) == (64, 4)
        shapes.append(shape)
        costs.append(flops(runner.lower(shape).compile()))
    assert shapes[0] == shapes[1] and costs[0] == pytest.approx(costs[1], rel=0.01)
    padded = flops(runner.lower(StepShape(False, 64, 64, PAGES, draft_tokens=D)).compile())
    assert padded > 1.5 * costs[0], (padded, costs[0])


def test_speculative_buckets_follow_the_requests_of_the_agreement():
    """Decode buckets by requests (a verify after a stretch is one row, its drafts none), the extend steps' slot
    ladder, and with a threshold the plain steps of the stretches beside them, all compiled at start-up."""
    b = Buckets.make(16, 64, 2, draft_tokens=D, spec_off_above=6).with_pages(PAGES, 8)
    # 5 requests on rank 0, 3 of them without drafts (1 + 2 x 4 + 3 x 1 = 12 rows), 1 on rank 1: bucket 8, not 4
    agreement = agree_on_step(proposals([12, 4], [5, 1], extend=False))
    shape = b.shape_for([12, 4], agreement)
    assert (shape.absorbed, shape.num_requests, shape.num_rows) == (True, 8, 32) and shape in b.shapes()
    shape = b.shape_for([40, 8], agree_on_step(proposals([40, 8], [5, 2], extend=True)))  # a prompt read
    assert (shape.absorbed, shape.num_rows, shape.num_seqs) == (False, 64, 16) and shape in b.shapes()
    plain = b.shape_for([12, 4], agreement, plain=True)  # a stretch's decode step: a row a request, 12 on rank 0
    assert (plain.absorbed, plain.draft_tokens, plain.num_rows) == (True, 0, 12) and plain in b.shapes()
    always = Buckets.make(16, 64, 2, draft_tokens=D).with_pages(PAGES, 8).shapes()
    assert set(b.shapes()) - set(always) == {s for s in b.shapes() if not s.draft_tokens}  # (only the plain ones)
    assert b.slot_buckets(64) == [4, 16] and b.slot_buckets(16) == [4, 16] and b.slot_buckets(8) == [4, 8]
    assert Buckets.make(256, 64, 2, draft_tokens=D).slot_buckets(1024) == [4, 16, 64, 256]
    spec_extend = [s for s in b.shapes() if not s.absorbed]
    assert {(s.num_rows, s.num_seqs) for s in spec_extend} >= {(64, 4), (64, 16), (8, 4), (8, 8)}
    for rows, requests, bucket in (([64, 0], [1, 0], (64, 4)), ([60, 12], [5, 3], (64, 16)),
                                   ([32, 20], [16, 5], (32, 16)), ([3, 0], [3, 0], (8, 4))):
        shape = b.shape_for(rows, agree_on_step(proposals(rows, requests, extend=True)))
        assert (shape.num_rows, shape.num_seqs) == bucket
