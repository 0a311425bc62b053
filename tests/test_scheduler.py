"""The host loop without a model: the engine over `HostOnlyRunner` (a stand-in step that returns at once), so
scheduling, admission, booking and failure handling are checked in milliseconds. Greedy numbers against a
real model are tests/test_engine.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.engine import BadRequest, Engine, EngineConfig, SamplingParams
from jaxdp.engine.sched.rows import sampling_row
from jaxdp.engine.step.sampling import sample_tokens
from jaxdp.testing import HostOnlyRunner

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


def host_engine(mesh="dp=2", runner_cls=HostOnlyRunner, **kw) -> Engine:
    base = dict(page_size=4, num_pages=16, max_running_requests=8, chunked_prefill_size=16,
                decode_buckets=[1, 2, 4], extend_buckets=[8, 16])
    cfg = EngineConfig(**(base | kw))
    return Engine(runner_cls("tiny", mesh, cfg.num_pages, cfg.page_size), mesh, cfg)


def pools_are_full(eng):
    for s in eng.schedulers:
        assert not s.running and not s.waiting and len(s.rows) == 0
        assert s.pool.free + s.cache.size == s.pool.num_pages  # no page leaked
        assert s.cache.evictable() == s.cache.size  # and none still locked


def test_decode_rows_follow_requests_that_join_and_leave():
    eng = host_engine()
    lengths = [3, 7, 1, 5, 2]
    reqs = eng.generate([[5, 6, 7]] * 5, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths],
                        ranks=[0] * 5)
    assert [len(r.output_ids) for r in reqs] == lengths and all(r.output_ids == [1] * len(r.output_ids)
                                                                 for r in reqs)
    pools_are_full(eng)


def test_a_request_that_can_never_fit_is_refused_at_once():
    eng = host_engine("dp=1", num_pages=8)  # 32 tokens; all of a request's output is reserved (no DP: x1)
    eng.make_request(list(range(20)), SamplingParams(max_new_tokens=10))  # 5 pages + 3 reserved: fits
    with pytest.raises(BadRequest, match="pages but a rank's KV pool has 8"):
        eng.make_request(list(range(29)), SamplingParams(max_new_tokens=3))  # 8 pages + 1 reserved


def test_a_request_that_cannot_fit_now_does_not_block_those_behind_it():
    eng = host_engine(num_pages=10, chunked_prefill_size=64, extend_buckets=[8, 16, 32])
    long = eng.submit(eng.make_request(list(range(8)), SamplingParams(max_new_tokens=24, ignore_eos=True), rank=0))
    eng.step()
    eng.step()  # running: 2 prompt pages + 2 reserved of rank 0's 10
    big = eng.submit(eng.make_request(list(range(25)), SamplingParams(max_new_tokens=2), rank=0))  # 7 + 1 pages
    small = eng.submit(eng.make_request([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True), rank=0))
    for _ in range(6):
        eng.step()
    assert small.finished and not big.finished and not big.pages  # small went past big, which waits its turn
    eng.run_until_idle()
    assert long.finished and big.finished and len(big.output_ids) == 2
    pools_are_full(eng)


def test_a_step_passes_over_a_bounded_number_of_requests_that_cannot_fit_now():
    """A queue of requests that cannot fit now costs a bounded scan per step: past PASS_OVER_LIMIT of them, a
    request that would fit waits for a later step (they all run in the end)."""
    from jaxdp.engine.sched.scheduler import PASS_OVER_LIMIT

    def queue(skipped: int):
        eng = host_engine(num_pages=10, chunked_prefill_size=64, extend_buckets=[8, 16, 32],
                          max_running_requests=64)
        eng.submit(eng.make_request(list(range(8)), SamplingParams(max_new_tokens=24, ignore_eos=True), rank=0))
        eng.step()
        eng.step()  # running: 2 prompt pages + 2 reserved of rank 0's 10
        big = [eng.submit(eng.make_request(list(range(25)), SamplingParams(max_new_tokens=2), rank=0))
               for _ in range(skipped)]
        small = eng.submit(eng.make_request([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True), rank=0))
        eng.step()
        return eng, big, small

    eng, big, small = queue(PASS_OVER_LIMIT - 1)
    assert small.pages and not any(b.pages for b in big)  # read this step, past the ones that cannot fit
    eng, big, small = queue(PASS_OVER_LIMIT)
    assert not small.pages  # the scan stopped before it
    eng.run_until_idle()
    assert small.finished and all(b.finished and len(b.output_ids) == 2 for b in big)
    pools_are_full(eng)


class FailingRunner(HostOnlyRunner):
    """Fails the step that reads the token `poison` (an engine bug that only some batch triggers)."""

    poison = 13

    def run(self, shape, stacked, prev_tokens=None):
        if (stacked["tokens_T"] == self.poison).any():
            raise RuntimeError("boom")
        return super().run(shape, stacked, prev_tokens)


def test_a_failed_step_fails_only_the_request_that_fails_it_and_caches_no_unwritten_page():
    eng = host_engine(runner_cls=FailingRunner)
    others = [eng.submit(eng.make_request([4] * 9, GREEDY, rank=r)) for r in (0, 1)]
    eng.step()
    eng.step()
    assert all(r.output_ids for r in others)  # decoding
    more = [eng.submit(eng.make_request([3, 3], GREEDY, rank=0))]
    bad = eng.submit(eng.make_request([FailingRunner.poison] * 9, GREEDY, rank=0))  # 9 tokens: two full pages
    more += [eng.submit(eng.make_request([2, 2], GREEDY, rank=0)) for _ in range(2)]
    eng.step()  # rank 0 reads 4 prompts, rank 1 decodes (as one-token extends): the step fails, and again with
    # rank 0's plan alone (rank 1's alone runs), then with either half of it, then with `bad` alone
    assert bad.finished and bad.finish_reason == "abort" and "failed the engine step" in bad.error
    assert eng.schedulers[0].cache.size == 0  # its pages were never written: none entered the cache
    eng.run_until_idle()
    assert [(r.finish_reason, r.output_ids) for r in others + more] == [("length", [1] * 6)] * 5
    again = eng.generate([[4] * 9], GREEDY, ranks=[0])[0]
    assert again.output_ids == [1] * 6 and again.cached_tokens == 8  # the cache holds the written pages only
    pools_are_full(eng)


def test_sampling_rows_hold_any_value_the_api_lets_through():
    V = 64
    row = sampling_row(SamplingParams(temperature=10**400, top_p=float("nan"), top_k=2**31, min_p=-1, seed=-5),
                       "r", 0, V)
    s64 = 2**64 - 5  # seed -5 in the API's 64-bit range, folded to the key's 32 bits
    assert row[:6] == (1e4, 1.0, -1, 0.0, (s64 ^ (s64 >> 32)) & 0xFFFFFFFF, 0)  # (min_tokens 0: nothing banned)
    assert (row[6] == -1).all()
    seed = [sampling_row(SamplingParams(seed=s), "r", 0, V)[4] for s in (7, 7 + 2**32, 2**64 - 1)]
    assert seed[0] == 7 and len(set(seed)) == 3  # 32-bit seeds unchanged; s and s + 2^32 no longer collide
    assert sampling_row(SamplingParams(top_k=2147483648), "r", 0, V)[2] == -1
    logits = jax.random.normal(jax.random.key(0), (1, 2, V))
    t, p, m = (jnp.asarray(np.full((1, 2), v, np.float32)) for v in (1.0, 1.0, 0.0))
    k = jnp.asarray(np.asarray([[2**31 - 1, V + 5]], np.int32))  # past the vocabulary: all of it
    keys = jnp.zeros((1, 2, 2), jnp.uint32)
    tokens, logprobs = sample_tokens(logits, t, p, k, m, keys)
    assert tokens.shape == (1, 2) and bool(jnp.all((tokens >= 0) & (tokens < V)))
    assert bool(jnp.all(jnp.isfinite(logprobs)))


def test_the_controller_ledger_forgets_refused_finished_and_abandoned_requests():
    from jaxdp.api.replicas import ReplicaSet
    from jaxdp.engine.sched.controller import UNSUBMITTED_S

    eng = host_engine()
    b = ReplicaSet([eng], "total_tokens")
    with pytest.raises(BadRequest, match="routed_dp_rank"):
        b.make_request([1, 2], GREEDY, rid="x", rank=9)
    with pytest.raises(BadRequest, match="shorten the prompt"):
        b.make_request(list(range(70)), GREEDY, rid="x")
    x = b.make_request([1, 2], GREEDY, rid="x")  # a refused rid is free at once
    with pytest.raises(BadRequest, match="already running"):
        b.make_request([1, 2], GREEDY, rid="x")
    assert b.loads()[x.dp_rank] == (2 / b.capacity(x.dp_rank), 1)  # counted before the loop admits it
    eng.submit(x)
    eng.run_until_idle()
    assert x.finished and b.loads() == [(0.0, 0)] * 2 and b.make_request([3], GREEDY, rid="x").rid == "x"
    gone = b.make_request(list(range(9)), GREEDY)  # made, never submitted (its client went away)
    assert sum(n for _, n in b.loads()) == 2
    gone.created -= UNSUBMITTED_S + 1
    assert sum(n for _, n in b.loads()) == 1  # only the second "x" still counts


def test_extend_buckets_for_a_chunk_under_eight_rows():
    """A per-rank chunk and batch below the smallest default bucket (8) still get a bucket that holds them."""
    from jaxdp.engine.step.buckets import Buckets

    assert Buckets.make(max_running=2, chunk=4, dp=2).extend == [4]
    assert Buckets.make(max_running=64, chunk=256, dp=8).extend[:2] == [8, 16]


def test_a_runner_with_another_page_size_is_refused():
    """The runner's pool and the engine's page table must agree on the page size, or every slot is wrong."""
    cfg = EngineConfig(page_size=4, num_pages=16, decode_buckets=[1], extend_buckets=[8])
    with pytest.raises(ValueError, match="page_size 4 differs from the step runner's 8"):
        Engine(HostOnlyRunner("tiny", "dp=2", cfg.num_pages, 8), "dp=2", cfg)
