"""The engine on 8 CPU devices (dp=8): continuous batching, prefix reuse, pools, retraction, chunked
prefill, sampling, and no compile after warm-up."""

import asyncio

import jax
import numpy as np
import pytest

from jaxdp.engine import BadRequest, Engine, EngineConfig, SamplingParams
from jaxdp.engine.step.step_stats import compiles_on_this_thread, compiles_total
from jaxdp.one_batch import run_prompts

pytestmark = pytest.mark.usefixtures("blocked_prompt_path")  # the form real sizes run (conftest)

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


def small_config(**kw):
    # per rank: 4 requests, prompt chunks of 16; extend steps up to 8 rows pad (MAX_LEN, with decoding ranks
    # relabeled as one-token extends), 16-row steps use the SUM_LEN exact buffer
    base = dict(page_size=4, num_pages=64, max_running_requests=32, chunked_prefill_size=128,
                decode_buckets=[1, 2, 4], extend_buckets=[8, 16], max_len_extend_rows=8)
    return EngineConfig(**(base | kw))


@pytest.fixture(scope="module")
def engine():
    with jax.default_matmul_precision("highest"):
        eng = Engine("tiny", "dp=8", small_config(), seed=0)
        yield eng
        eng.shutdown()


def pools_are_full(eng):
    for s in eng.schedulers:
        assert not s.running and not s.waiting
        assert s.pool.free + s.cache.size == s.pool.num_pages  # no page leaked
        assert s.cache.evictable() == s.cache.size  # and none still locked


def prompts(n, seed, lo=2, hi=14):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def test_continuous_batching_equals_each_request_alone(engine):
    ps = prompts(10, 1)
    with jax.default_matmul_precision("highest"):
        first = [engine.submit(engine.make_request(p, GREEDY, rank=i % 4)) for i, p in enumerate(ps[:5])]
        for _ in range(3):
            engine.step()  # the first five are decoding when the next five arrive
        lengths = [SamplingParams(max_new_tokens=3 + i % 4, temperature=0) for i in range(5)]
        later = [engine.submit(engine.make_request(p, sp, rank=i % 4))
                 for i, (p, sp) in enumerate(zip(ps[5:], lengths, strict=True))]
        engine.run_until_idle()
        reqs = first + later
        assert all(r.finished and r.finish_reason == "length" for r in reqs)
        assert any(rec.idle_ranks for rec in engine.stats.records)  # ranks 4..7 ran idle batches
        engine.flush_cache()
        for r in reqs:
            alone = engine.generate([r.prompt_ids], r.params, ranks=[r.rank])[0]
            assert alone.output_ids == r.output_ids
    pools_are_full(engine)


def test_prefix_cache_reuse_on_the_same_rank_only(engine):
    first_turn = prompts(1, 2, 18, 19)[0]
    with jax.default_matmul_precision("highest"):
        a = engine.generate([first_turn], GREEDY, ranks=[2])[0]
        second_turn = a.all_ids + [7, 8, 9]
        same = engine.generate([second_turn], GREEDY, ranks=[2])[0]
        other = engine.generate([second_turn], GREEDY, ranks=[5])[0]
    assert same.cached_tokens >= 16 and other.cached_tokens == 0
    assert same.output_ids == other.output_ids
    pools_are_full(engine)


def test_long_prompt_is_chunked_and_matches_unchunked(engine):
    prompt = prompts(1, 3, 40, 41)[0]  # the per-rank chunk is 128 / 8 = 16 tokens: three chunks
    with jax.default_matmul_precision("highest"):
        engine.stats.records.clear()
        req = engine.generate([prompt], SamplingParams(max_new_tokens=5, temperature=0), ranks=[1])[0]
        kinds = [(r.kind, r.gather_mode, r.rows[1]) for r in engine.stats.records]
        assert kinds[:3] == [("extend", "sum_len", 16), ("extend", "sum_len", 16), ("extend", "max_len", 8)]
        assert [k for k, _, _ in kinds[3:]] == ["decode"] * 4
        runner = engine.runner
        ref = run_prompts(_single_device_runner(runner), [prompt], [0], 5)
    assert req.output_ids == ref["tokens"][0].tolist()


def _single_device_runner(runner, num_pages=16):
    from jaxdp.layout import Layout
    from jaxdp.parallel.step import StepRunner

    model = __import__("flax").nnx.merge(runner.graphdef, jax.device_get(runner.state))
    lay = Layout()
    return StepRunner(model, lay, lay.make_mesh(jax.devices()[:1]), num_pages=num_pages, page_size=4)


def test_abort_frees_pages(engine):
    req = engine.submit(engine.make_request(prompts(1, 4)[0], SamplingParams(max_new_tokens=50, temperature=0),
                                            rank=6))
    for _ in range(3):
        engine.step()
    engine.abort(req.rid)
    engine.run_until_idle()
    engine.step()
    assert req.finish_reason == "abort" and len(req.output_ids) < 50
    pools_are_full(engine)


def test_sampling_parameters(engine):
    p = prompts(1, 5)[0]
    seeded = SamplingParams(max_new_tokens=8, temperature=1.5, seed=11, return_logprob=True)
    a, b = (engine.generate([p], seeded, ranks=[0])[0] for _ in range(2))
    assert a.output_ids == b.output_ids and len(a.output_logprobs) == 8 and max(a.output_logprobs) <= 0
    greedy = engine.generate([p], SamplingParams(max_new_tokens=8, temperature=0), ranks=[0])[0]
    top1 = engine.generate([p], SamplingParams(max_new_tokens=8, temperature=2.0, top_k=1, seed=3), ranks=[0])[0]
    assert top1.output_ids == greedy.output_ids
    others = {tuple(engine.generate([p], SamplingParams(max_new_tokens=8, temperature=1.5, seed=s))[0].output_ids)
              for s in range(4)}
    assert len(others) > 1  # different seeds sample differently
    stop_at = greedy.output_ids[2]
    stopped = engine.generate([p], SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[stop_at]))[0]
    assert stopped.output_ids == greedy.output_ids[: greedy.output_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_new_tokens=0), dict(top_k=0)):
        with pytest.raises(BadRequest):
            engine.make_request(p, SamplingParams(**bad))
    with pytest.raises(BadRequest, match="empty"):
        engine.make_request([], GREEDY)
    with pytest.raises(BadRequest, match="routed_dp_rank"):
        engine.make_request(p, GREEDY, rank=8)


def test_no_compile_after_warmup_over_a_mixed_workload(engine):
    before = compiles_total()
    in_steps = engine.stats.compiles_in_steps
    ps = prompts(24, 6, 1, 30)
    params = [SamplingParams(max_new_tokens=1 + i % 7, temperature=(i % 3) * 0.5, top_p=0.9, seed=i) for i in range(24)]
    reqs = [engine.submit(engine.make_request(p, sp)) for p, sp in zip(ps, params, strict=True)]
    engine.run_until_idle()
    assert all(r.finished for r in reqs)
    assert compiles_total() == before and engine.stats.compiles_in_steps == in_steps
    pools_are_full(engine)


def test_compiles_are_counted_per_thread():
    """An engine counts the compiles of its own loop thread: another thread's (another replica's) are not its."""
    import threading

    mine, total = compiles_on_this_thread(), compiles_total()
    t = threading.Thread(target=lambda: jax.jit(lambda x: x * 3 + 1).lower(np.ones(5, np.int16)).compile())
    t.start()
    t.join()
    assert compiles_total() == total + 1 and compiles_on_this_thread() == mine
    jax.jit(lambda x: x * 5 - 2).lower(np.ones(7, np.int16)).compile()
    assert compiles_on_this_thread() == mine + 1


def test_async_streaming(engine):
    async def run():
        engine.start()
        try:
            req = engine.make_request(prompts(1, 7)[0], SamplingParams(max_new_tokens=5, temperature=0))
            seen = [len(r.output_ids) async for r in engine.stream(req)]
            return req, seen
        finally:
            engine.stop()

    req, seen = asyncio.run(run())
    assert req.finished and seen[-1] == 5 and seen == sorted(seen)


def test_overlap_queues_the_next_step_before_reading_tokens(engine):
    req = engine.submit(engine.make_request(prompts(1, 9)[0], SamplingParams(max_new_tokens=4, temperature=0),
                                            rank=0))
    engine.step()  # the prompt step is queued; its token is not read back yet
    assert engine._inflight is not None and req.output_ids[0] < 0  # a marker for the token in flight
    engine.step()  # the first decode step is queued reading that token on the device; then it is booked
    assert req.output_ids[0] >= 0 and req.output_ids[1] < 0
    engine.run_until_idle()
    assert req.finished and len(req.output_ids) == 4 and min(req.output_ids) >= 0
    pools_are_full(engine)


def test_disable_overlap_schedule_reaches_the_engine():
    from jaxdp.serve import build_parser, engine_config

    parse = build_parser().parse_args
    assert engine_config(parse([]), 64).overlap  # SGLang's default: on
    assert not engine_config(parse(["--disable-overlap-schedule"]), 64).overlap


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])  # (CI: the default)
def test_retraction_keeps_outputs_and_frees_everything(overlap):
    cfg = small_config(num_pages=10, max_running_requests=8, chunked_prefill_size=16, decode_buckets=[1, 2, 4],
                       overlap=overlap)
    ps = prompts(8, 8, 5, 8)
    sp = SamplingParams(max_new_tokens=14, temperature=0)
    with jax.default_matmul_precision("highest"):
        eng = Engine("tiny", "dp=2", cfg, seed=0)
        reqs = eng.generate(ps, sp)
        assert sum(s.retracted_total for s in eng.schedulers) > 0  # the pool (40 tokens per rank) ran out
        assert all(r.finish_reason == "length" and len(r.output_ids) == 14 for r in reqs)
        pools_are_full(eng)
        eng.flush_cache()
        for r in reqs:
            assert eng.generate([r.prompt_ids], sp, ranks=[r.rank])[0].output_ids == r.output_ids
        pools_are_full(eng)
        with pytest.raises(BadRequest, match="shorten the prompt"):  # can never fit a rank's pool of 40 tokens
            eng.make_request(list(range(45)), SamplingParams(max_new_tokens=2))
        eng.shutdown()


def test_stop_strings_through_the_tokenizer(engine):
    from jaxdp.engine.sched.request import Request, stop_string_check
    from jaxdp.model.loader import default_model_path
    from jaxdp.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_path())
    ids = tok.encode("12+34=46", add_special_tokens=False)
    check = stop_string_check(tok, ["=4"])
    req = Request("r", [1], SamplingParams(), output_ids=ids[: ids.index(tok.encode("=", add_special_tokens=False)[0])])
    assert not check(req)
    req.output_ids = ids + [-1]  # a token still in flight is ignored
    assert check(req)
    with pytest.raises(BadRequest, match="tokenizer"):  # the tiny preset has none: say so
        engine.make_request([1, 2], SamplingParams(stop=["x"]))
    engine.tokenizer = tok
    try:
        r = engine.make_request([1, 2], SamplingParams(stop="=4"))
        assert r.stop_check is not None and r.params.stop == ["=4"]
    finally:
        engine.tokenizer = None


def test_greedy_outputs_equal_one_batch_reference_with_cache_chunks_retraction_and_overlap(engine):
    """The loop's greedy tokens equal an independent reference (all prompts in one batch on one device, no
    scheduler) while the prefix cache, chunked prefill, retraction and the overlap all take part."""
    rng = np.random.default_rng(12)
    prefix = rng.integers(0, 512, 8).tolist()  # two pages of 4 shared by every prompt
    ps = [prefix + rng.integers(0, 512, 32).tolist() for _ in range(6)]  # 40 tokens: chunks of 16, 16, 8
    sp = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    assert engine.cfg.overlap
    with jax.default_matmul_precision("highest"):
        engine.flush_cache()
        warm = engine.generate([prefix + [1, 2, 3]], sp, ranks=[3])[0]  # puts the prefix in rank 3's cache
        retracted = engine.schedulers[3].retracted_total
        # rank 3 runs 4 at a time: 2 shared pages and 4 x 16 of their own (72 tokens each) pass its 64
        reqs = engine.generate(ps, sp, ranks=[3] * len(ps))
        assert engine.schedulers[3].retracted_total > retracted
        assert all(r.cached_tokens >= 8 for r in reqs)
        ref = run_prompts(_single_device_runner(engine.runner, num_pages=160), [prefix + [1, 2, 3], *ps],
                          [0] * 7, 32)
    assert warm.output_ids == ref["tokens"][0].tolist()
    for i, r in enumerate(reqs):
        assert r.finish_reason == "length" and r.output_ids == ref["tokens"][i + 1].tolist(), i
    pools_are_full(engine)


def test_page_buckets_grow_by_four_up_to_the_context():
    from jaxdp.engine.step.buckets import page_buckets

    assert page_buckets(2560, 64) == [64, 256, 1024, 2560]  # DeepSeek-V3's context in pages of 64
    assert page_buckets(6, 16) == [6]  # a context under the smallest bucket: one width, as before


@pytest.mark.slow  # two engines compile every bucket: 45 s on the 2-core CI machine
def test_page_table_width_follows_the_longest_sequence_and_tokens_do_not_change(monkeypatch):
    """Each step's page table is as wide as its longest sequence needs (a page bucket), not the whole
    context: the same greedy tokens as one full-width table, and short steps run the narrow tables."""
    import jaxdp.engine.step.buckets as buckets_mod
    cfg = small_config(num_pages=48, context_length=128, max_running_requests=8, chunked_prefill_size=32,
                       decode_buckets=[4], extend_buckets=[16])  # few buckets: two engines compile them all
    ps = [list(range(1, 3 + 9 * i)) for i in range(6)]  # 2 .. 47 tokens: 1 to 13 pages with the output
    sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

    def run(bucket_tokens: int):
        monkeypatch.setattr(buckets_mod, "PAGE_BUCKET_TOKENS", bucket_tokens)
        with jax.default_matmul_precision("highest"):
            eng = Engine("tiny", "dp=2", cfg, seed=0)
        widths, run_step = [], eng.runner.run
        eng.runner.run = lambda shape, *a, **k: widths.append(shape.pages_per_seq) or run_step(shape, *a, **k)
        try:
            with jax.default_matmul_precision("highest"):
                return [r.output_ids for r in eng.generate(ps, sp)], eng.buckets.pages, widths
        finally:
            eng.shutdown()

    narrow, pages, widths = run(32)  # widths 8 and 32 pages
    full, full_pages, full_widths = run(1 << 20)
    assert pages == (8, 32) and full_pages == (32,) and set(full_widths) == {32}
    assert set(widths) == {8, 32} and narrow == full
