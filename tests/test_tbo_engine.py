"""Two-batch overlap served: an engine with --enable-two-batch-overlap gives the greedy tokens of one without."""

import jax
import numpy as np
import pytest

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.step.step_stats import compiles_total

pytestmark = pytest.mark.usefixtures("blocked_prompt_path")  # the form real sizes run (conftest)


@pytest.mark.slow  # two engines compile every bucket (the split shapes too): 333 s on 2 cores at load average 9-11
def test_served_tokens_equal_with_and_without_the_split():
    """Under dp=8,moe=ep, two prompts a rank of equal length (a balanced split) and six tokens each: the engine
    with the split runs split prompt and decode steps, compiles nothing after its start-up, and every request's
    tokens equal the engine's without the split."""
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 512, 6).tolist() for _ in range(16)]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    base = dict(page_size=4, num_pages=64, max_running_requests=32, chunked_prefill_size=128,
                decode_buckets=[2, 4], extend_buckets=[8, 16], max_len_extend_rows=8)
    outs, split_kinds = {}, set()
    with jax.default_matmul_precision("highest"):
        for thr in (None, 0.48):
            eng = Engine("tiny", "dp=8,moe=ep", EngineConfig(**base, tbo_threshold=thr), seed=0)
            try:
                run = eng.runner.run

                def counting(shape, *a, run=run, **k):
                    if shape.micro_rows:
                        split_kinds.add(shape.kind)
                    return run(shape, *a, **k)

                eng.runner.run = counting
                before = compiles_total()
                reqs = [eng.submit(eng.make_request(p, greedy, rank=i % 8)) for i, p in enumerate(ps)]
                eng.run_until_idle()
                assert all(r.finished for r in reqs)
                assert compiles_total() == before  # every split shape compiled at start-up
                outs[thr] = [r.output_ids for r in reqs]
            finally:
                eng.shutdown()
    assert split_kinds == {"extend", "decode"}
    assert outs[0.48] == outs[None]
