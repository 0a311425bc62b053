"""Sampling controls inside the step: min_tokens / min_new_tokens (the stop rule and the sampler's mask), from
the API's fields to the tokens of an engine under dp=8 and tp=8 (the same greedy tokens as one device)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.api.common import ApiError
from jaxdp.api.native import _params as native_params
from jaxdp.api.openai_api import _params as openai_params
from jaxdp.config import get_config
from jaxdp.engine import BadRequest, Engine, EngineConfig, SamplingParams
from jaxdp.engine.options import SpeculativeConfig
from jaxdp.engine.sched.finish import finish_reason
from jaxdp.engine.sched.request import BAN_WIDTH, MAX_MIN_TOKENS_STOP_IDS, Request
from jaxdp.engine.sched.rows import sampling_row
from jaxdp.engine.step.sampling import sample_tokens
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.mtp import MTPLayer
from jaxdp.parallel.step import StepRunner

V = 512


class Ctx:
    vocab_size = V


def test_min_tokens_holds_off_eos_and_stop_ids_from_the_api_on():
    """min_tokens (OpenAI endpoints, vLLM's name) and min_new_tokens (SGLang's) reach the request; the stop rule
    lets nothing but the length end it below its floor; what cannot be served is one sentence."""
    assert openai_params(Ctx(), {"max_tokens": 8, "min_tokens": 3}, 16).min_new_tokens == 3
    sps, _, _ = native_params(Ctx(), {"sampling_params": {"max_new_tokens": 8, "min_new_tokens": 5}}, 1)
    assert sps[0].min_new_tokens == 5
    with pytest.raises(ApiError, match=r"^min_tokens must be an integer from 0 to"):
        openai_params(Ctx(), {"min_tokens": -1}, 16)
    with pytest.raises(BadRequest, match=r"min_new_tokens \(min_tokens\) must be an integer from 0 to max_new_tokens "
                                         r"\(4\), got 5$"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5).validate()
    with pytest.raises(BadRequest, match="may hold at most 16 stop_token_ids, got 17; send fewer"):
        SamplingParams(min_new_tokens=1, stop_token_ids=list(range(MAX_MIN_TOKENS_STOP_IDS + 1))).validate()

    req = Request("a", [1], SamplingParams(max_new_tokens=8, min_new_tokens=3, stop_token_ids=[9]))
    req.stop_check = lambda r: True  # a stop string in the text: held off too
    eos = {2}
    assert [finish_reason(req, t, n, 8, eos) for t, n in [(2, 1), (9, 2), (5, 2)]] == [None, None, None]
    assert [finish_reason(req, t, 3, 8, eos) for t in (2, 9)] == ["stop", "stop"]
    short = Request("b", [1], SamplingParams(max_new_tokens=4, min_new_tokens=3))
    assert finish_reason(short, 2, 2, 2, eos) == "length"  # (a context limit under the floor: the length ends it)


def test_a_rows_ban_holds_its_eos_and_stop_ids_unless_it_ignores_eos():
    params = SamplingParams(min_new_tokens=2, stop_token_ids=[9, 4])
    *_, floor, ban = sampling_row(params, "r", 0, V, eos_token_ids=(4, 1))
    assert floor == 2 and ban.shape == (BAN_WIDTH,) and ban[:4].tolist() == [9, 4, 1, -1] and (ban[3:] == -1).all()
    *_, ban = sampling_row(SamplingParams(min_new_tokens=2, stop_token_ids=[9], ignore_eos=True), "r", 0, V, (4,))
    assert ban[:2].tolist() == [9, -1]
    *_, floor, ban = sampling_row(SamplingParams(stop_token_ids=[9]), "r", 0, V, (4,))
    assert floor == 0 and (ban == -1).all()  # (no floor: nothing held off)


def test_the_sampler_masks_a_rows_ban_below_its_floor_and_reports_the_unmodified_logprob():
    """Rows [greedy below its floor, greedy at its floor, sampled below its floor, unconstrained]: the best
    token of every row is 7, which rows 0, 1 and 2 ban."""
    logits = jnp.zeros((1, 4, V)).at[:, :, 7].set(20.0).at[:, :, 11].set(10.0)
    t = jnp.asarray([[0.0, 0.0, 1.0, 0.0]])
    ones, zeros = jnp.ones((1, 4)), jnp.zeros((1, 4))
    keys = jnp.asarray([[[1, 0], [1, 3], [5, 1], [1, 0]]], jnp.uint32)  # (seed, tokens generated so far)
    floor = jnp.asarray([[3, 3, 3, 0]], jnp.int32)
    ban = jnp.full((1, 4, BAN_WIDTH), -1, jnp.int32).at[:, :3, 0].set(7)
    tokens, logprobs = sample_tokens(logits, t, ones, jnp.full((1, 4), -1, jnp.int32), zeros, keys, floor, ban)
    assert tokens[0, 0] == 11 and tokens[0, 1] == 7 and tokens[0, 2] != 7 and tokens[0, 3] == 7
    want = jax.nn.log_softmax(logits, axis=-1)[0, jnp.arange(4), tokens[0]]
    np.testing.assert_allclose(np.asarray(logprobs[0]), np.asarray(want), rtol=1e-6)
    plain, _ = sample_tokens(logits, t, ones, jnp.full((1, 4), -1, jnp.int32), zeros, keys)
    assert plain[0].tolist() == [7, 7, 7, 7]  # (without the floors)


def small_config(dp: int) -> EngineConfig:
    """Per rank: 8 requests, prompt chunks of 16 (test_engine's sizes)."""
    return EngineConfig(page_size=4, num_pages=64, max_running_requests=8 * dp, chunked_prefill_size=16 * dp,
                        decode_buckets=[1, 2, 4, 8], extend_buckets=[8, 16], max_len_extend_rows=8)


def run_layout(mesh_spec: str) -> list[tuple[list[int], str]]:
    """Prompts on ranks 0..7 (folded onto the layout's ranks), each decoded greedily twice: with a stop id at the
    token it would start with (it ends at once), and with that stop id held off for 4 tokens, beside rows
    without a floor."""
    prompts = [np.random.default_rng(i).integers(0, V, 6 + i).tolist() for i in range(8)]
    with jax.default_matmul_precision("highest"):
        dp = parse_mesh_spec(mesh_spec).dp
        eng = Engine("tiny", mesh_spec, small_config(dp), seed=0)
        try:
            ranks = [i % dp for i in range(8)]
            greedy = SamplingParams(max_new_tokens=8, temperature=0)
            firsts = [r.output_ids[0] for r in eng.generate(prompts, greedy, ranks=ranks)]
            compiles = eng.stats.compiles_in_steps
            params = [SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[f],
                                     min_new_tokens=4 if i % 2 == 0 else 0) for i, f in enumerate(firsts)]
            reqs = eng.generate(prompts, params, ranks=ranks)
            assert eng.stats.compiles_in_steps == compiles == 0  # compiled at start-up
        finally:
            eng.shutdown()
    for i, (req, first) in enumerate(zip(reqs, firsts, strict=True)):
        if i % 2:  # no floor: its stop id ends it at once
            assert req.output_ids == [first] and req.finish_reason == "stop"
        else:
            assert first not in req.output_ids[:4] and len(req.output_ids) >= 4, (i, req.output_ids)
            assert req.finish_reason == ("stop" if first in req.output_ids else "length")
    return [(r.output_ids, r.finish_reason) for r in reqs]


def test_min_tokens_gives_the_same_greedy_tokens_under_dp8_as_one_device():
    assert run_layout("dp=8") == run_layout("dp=1")


@pytest.mark.slow
def test_min_tokens_gives_the_same_greedy_tokens_under_tp8_as_one_device():
    """tp=8 splits the vocabulary of the LM head: the ban applies to the gathered logits all the same."""
    assert run_layout("tp=8") == run_layout("dp=1")


def test_min_tokens_on_a_speculating_server_is_refused_in_one_sentence():
    cfg = get_config("tiny")
    lay = parse_mesh_spec("dp=1")
    runner = StepRunner(DeepseekV3(cfg, nnx.Rngs(0)), lay, lay.make_mesh(jax.devices()[:1]), num_pages=32,
                        page_size=8, draft=MTPLayer(cfg, nnx.Rngs(1)))
    eng = Engine(runner, config=EngineConfig(max_running_requests=4, speculative=SpeculativeConfig(),
                                             disable_cuda_graph=True))
    try:
        with pytest.raises(BadRequest, match=r"^this server decodes speculatively \(--speculative-algorithm\), whose "
                                             r"verify does not apply min_tokens yet; .*decoding$"):
            eng.make_request([1, 2, 3], SamplingParams(min_new_tokens=2))
        assert eng.make_request([1, 2, 3], SamplingParams(max_new_tokens=2)).params.min_new_tokens == 0
    finally:
        eng.shutdown()
