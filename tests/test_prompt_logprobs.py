"""Prompt logprobs (SGLang's input_token_logprobs, vLLM's prompt_logprobs, OpenAI's echo) equal the offline
log-softmax of `python -m jaxdp.one_batch`'s logits (`run_prompts`, one device, one batch, no scheduler) under
dp=8, tp=8, dp=8 with EP and dp=8 with the whole LM head per rank: a prompt read in chunks, then again with a
prefix in the cache (recomputed from logprob_start_len on), beside a request that does not ask, whose steps
stay the ordinary ones."""

import jax
import numpy as np
import pytest

from jaxdp.engine import BadRequest, Engine, EngineConfig, SamplingParams
from jaxdp.one_batch import run_prompts

pytestmark = pytest.mark.usefixtures("blocked_prompt_path")  # the form real sizes run (conftest)

PROMPT = np.random.default_rng(5).integers(0, 512, 40).tolist()  # 16-token chunks per rank: three chunks
OTHER = np.random.default_rng(6).integers(0, 512, 12).tolist()
CHOSEN = [5, 7, 300]
_SLOW = pytest.mark.slow  # CI keeps dp=8 (the vocabulary-split head over the ranks); an engine each costs ~30 s
LAYOUTS = ["dp=8", pytest.param("tp=8", marks=_SLOW), pytest.param("dp=8,moe=ep", marks=_SLOW),
           pytest.param("dp=8,lm_head=dp", marks=_SLOW)]


def config(mesh: str) -> EngineConfig:
    dp = 1 if mesh.startswith("tp") else 8
    return EngineConfig(page_size=4, num_pages=64, max_running_requests=2 * dp, chunked_prefill_size=16 * dp,
                        decode_buckets=[1, 2], extend_buckets=[16], max_len_extend_rows=16)


@pytest.fixture(scope="module", params=LAYOUTS)
def engine(request):
    with jax.default_matmul_precision("highest"):
        eng = Engine("tiny", request.param, config(request.param), seed=0)
        yield eng
        eng.shutdown()


@pytest.fixture(scope="module")
def reference():
    """The offline logits of PROMPT on one device (the same seeded weights), as log-probabilities."""
    from jaxdp.layout import Layout
    from jaxdp.model.loader import load_model
    from jaxdp.parallel.step import StepRunner

    with jax.default_matmul_precision("highest"):
        lay = Layout()
        runner = StepRunner(load_model("tiny", "float32", seed=0)[1], lay, lay.make_mesh(jax.devices()[:1]),
                            num_pages=16, page_size=4)
        logits = run_prompts(runner, [PROMPT], [0], 1)["prompt"][0].astype(np.float64)
    m = logits.max(-1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))  # [position, vocab]


def test_prompt_logprobs_equal_one_batch_chunked_and_after_a_prefix_hit(engine, reference):
    want = np.asarray([reference[i - 1, PROMPT[i]] for i in range(1, len(PROMPT))])
    asks = SamplingParams(max_new_tokens=2, temperature=0, return_logprob=True, logprob_start_len=0, top_logprobs=3,
                          token_ids_logprob=CHOSEN)
    plain = SamplingParams(max_new_tokens=2, temperature=0)
    engine.flush_cache()
    steps = engine.prompt_logprob_steps
    alone = engine.generate([OTHER], plain)[0]
    assert engine.prompt_logprob_steps == steps  # a request that does not ask runs the ordinary steps
    with jax.default_matmul_precision("highest"):
        req, other = engine.generate([PROMPT, OTHER], [asks, plain], ranks=[0, 0])
    assert engine.prompt_logprob_steps == steps + 3  # the three chunks of PROMPT, OTHER's prompt beside the first
    assert other.output_ids == alone.output_ids and other.input_logprobs == []
    assert req.input_logprobs[0] is None and len(req.input_logprobs) == len(PROMPT)
    np.testing.assert_allclose(req.input_logprobs[1:], want, rtol=0, atol=1e-5)
    assert req.input_top_logprobs[0] is None
    for i, alts in enumerate(req.input_top_logprobs[1:]):
        assert [t for t, _ in alts] == np.argsort(-reference[i])[:3].tolist()
        np.testing.assert_allclose([v for _, v in alts], np.sort(reference[i])[::-1][:3], atol=1e-5)
        np.testing.assert_allclose([v for _, v in req.input_token_ids_logprobs[i + 1]], reference[i, CHOSEN],
                                   atol=1e-5)
    assert req.output_ids[0] == int(reference[-1].argmax())
    assert abs(req.output_logprobs[0] - reference[-1].max()) < 1e-5
    np.testing.assert_allclose([v for _, v in req.output_token_ids_logprobs[0]], reference[-1, CHOSEN], atol=1e-5)

    start = 21  # the cache holds PROMPT now: a prefix of whole pages up to position 20 is reused, the rest is read
    again = SamplingParams(max_new_tokens=1, temperature=0, return_logprob=True, logprob_start_len=start)
    with jax.default_matmul_precision("highest"):
        hit = engine.generate([PROMPT], again, ranks=[0])[0]
    assert 0 < hit.cached_tokens <= start - 1
    np.testing.assert_allclose(hit.input_logprobs, want[start - 1:], rtol=0, atol=1e-5)


def test_logprob_start_len_past_the_prompt_is_refused(engine):
    with pytest.raises(BadRequest, match="logprob_start_len 40 is past the prompt's 40 tokens"):
        engine.make_request(PROMPT, SamplingParams(logprob_start_len=40))
