"""The prefill delayer and mixed chunks in the engine (dp=2 on CPU devices): the same tokens with either option
as without; a mixed step gives the rank's decoders a token while it reads a prompt; the delayer holds a prompt
until the other rank has one (or the limit), and then both are read in one step."""

import jax
import numpy as np
import pytest

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.sched.delayer import DelayerConfig, PrefillDelayer


@pytest.fixture(scope="module")
def engine():
    # per rank: 4 requests, prompt chunks of 8 rows
    cfg = EngineConfig(page_size=4, num_pages=64, max_running_requests=8, chunked_prefill_size=16,
                       decode_buckets=[1, 2, 4], extend_buckets=[8, 16], max_len_extend_rows=8)
    with jax.default_matmul_precision("highest"):
        eng = Engine("tiny", "dp=2", cfg, seed=0)
        yield eng
        eng.shutdown()


def ids(n, seed):
    return np.random.default_rng(seed).integers(1, 512, n).tolist()


def run(engine, first, later, steps_between=3, between=None):
    """Submit `first` (prompt, new tokens, rank) requests, run a few steps (then call `between`), submit
    `later`, run to the end."""
    engine.flush_cache()
    engine.stats.records.clear()

    def submit(p, n, rank):
        return engine.submit(engine.make_request(p, SamplingParams(max_new_tokens=n, temperature=0), rank=rank))

    with jax.default_matmul_precision("highest"):
        reqs = [submit(*r) for r in first]
        for _ in range(steps_between):
            engine.step()
        if between:
            between()
        reqs += [submit(*r) for r in later]
        engine.run_until_idle()
    assert all(r.finished and r.finish_reason == "length" for r in reqs)
    return [r.output_ids for r in reqs], list(engine.stats.records)


def extend_tokens(records):
    return sum(r.new_tokens for r in records if r.kind == "extend")


def test_mixed_chunk_gives_decoders_tokens_during_a_prompt_and_the_same_tokens(engine):
    first, later = [(ids(4, 1), 16, 0)], [(ids(40, 2), 4, 0)]  # rank 0 decodes while it reads a 40-token prompt
    plain_out, plain = run(engine, first, later)
    engine.cfg.enable_mixed_chunk = True
    try:
        mixed_out, mixed = run(engine, first, later)
    finally:
        engine.cfg.enable_mixed_chunk = False
    assert mixed_out == plain_out
    assert extend_tokens(plain) == 2  # each request's first token
    assert extend_tokens(mixed) >= 2 + 5  # the decoder got a token in each of the prompt's chunk steps
    assert max(max(r.rows) for r in mixed) <= 8  # the decoder's row came out of the chunk


def test_delayer_holds_a_prompt_until_the_limit_and_keeps_the_tokens(engine):
    first, later = [(ids(4, 3), 12, 1)], [(ids(6, 4), 4, 0)]  # rank 1 decodes; a prompt arrives on rank 0
    plain_out, plain = run(engine, first, later)
    d = PrefillDelayer(DelayerConfig(max_delay_passes=4), dp=2)
    try:  # on once rank 1 decodes
        held_out, held = run(engine, first, later, between=lambda: setattr(engine, "delayer", d))
    finally:
        engine.delayer = None
    assert held_out == plain_out
    assert d.wait_passes == 4 and d.outcomes["wait_timeout"] == 1 and d.outcomes["delay"] == 4
    def prompt_step(records):  # the step that reads rank 0's prompt
        return next(i for i, r in enumerate(records) if r.rows[0] > 1)

    # rank 1 decoded alone while rank 0 announced its prompt (one pass) and waited (four)
    assert prompt_step(held) == prompt_step(plain) + 1 + 4


def test_delayer_reads_prompts_of_two_ranks_in_one_step(engine):
    engine.delayer = PrefillDelayer(DelayerConfig(max_delay_passes=30), dp=2)
    try:
        # rank 0's prompt arrives, rank 1's one pass later: rank 0 waits for it
        out, records = run(engine, [(ids(6, 5), 3, 0)], [(ids(7, 6), 3, 1)], steps_between=1)
        d = engine.delayer
    finally:
        engine.delayer = None
    assert d.outcomes["delay"] >= 1 and d.outcomes["wait_success"] == 1 and d.outcomes["wait_timeout"] == 0
    assert any(r.kind == "extend" and r.rows == [6, 7] for r in records)  # both prompts in one step
    alone = [run(engine, [(ids(6, 5), 3, 0)], [])[0][0], run(engine, [(ids(7, 6), 3, 1)], [])[0][0]]
    assert out == alone


def test_mixed_chunk_rows_keep_the_persistent_batch_and_its_pages():
    """Host only (a stand-in step): the decoders a prompt's chunks carry are decode rows of the persistent
    batch: every one gets all its tokens, those crossing a page take it in the mixed step, none leaks."""
    from jaxdp.testing import HostOnlyRunner

    cfg = EngineConfig(page_size=4, num_pages=32, max_running_requests=8, chunked_prefill_size=16,
                       decode_buckets=[1, 2, 4], extend_buckets=[8, 16], enable_mixed_chunk=True)
    eng = Engine(HostOnlyRunner("tiny", "dp=2", cfg.num_pages, cfg.page_size), "dp=2", cfg)
    p = SamplingParams(max_new_tokens=12, ignore_eos=True)
    decoders = [eng.submit(eng.make_request([5, 6, 7], p, rank=0)) for _ in range(3)]
    eng.step()  # their prompts
    prompt = eng.submit(eng.make_request(list(range(1, 41)), SamplingParams(max_new_tokens=2, ignore_eos=True),
                                         rank=0))
    eng.run_until_idle()
    assert all(r.output_ids == [1] * 12 for r in decoders) and prompt.output_ids == [1, 1]
    mixed = [r for r in eng.stats.records if r.kind == "extend" and r.rows[0] == 8]
    assert len(mixed) >= 5  # the 40-token prompt in chunks of 5 beside the 3 decoders
    assert sum(r.new_tokens for r in mixed) >= 3 * 5  # the decoders got a token in each (the prompt's first: 1)
    for s in eng.schedulers:
        assert not s.running and not s.waiting and len(s.rows) == 0
        assert s.pool.free + s.cache.size == s.pool.num_pages  # no page leaked, none still locked
        assert s.cache.evictable() == s.cache.size
