"""Sampling controls inside the step: min_tokens / min_new_tokens (the stop rule and the sampler's mask), logit_bias,
frequency / presence / repetition penalties (their state on the device) and a grammar's bitmask (the engine side,
with a fake matcher written here), from the API's fields to the tokens of an engine under dp=8 and tp=8 (the same
greedy tokens as one device, and on one device the tokens a numpy reference chooses from teacher-forced logits)."""

import concurrent.futures
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.api.common import ApiError
from jaxdp.api.native import _params as native_params
from jaxdp.api.openai_api import _params as openai_params
from jaxdp.batch import CONTROL_KEYS
from jaxdp.config import get_config
from jaxdp.engine import BadRequest, Engine, EngineConfig, SamplingParams
from jaxdp.engine import loop as loop_module
from jaxdp.engine.options import SpeculativeConfig
from jaxdp.engine.sched.finish import finish_reason
from jaxdp.engine.sched.request import BAN_WIDTH, MAX_MIN_TOKENS_STOP_IDS, GrammarSpec, Request
from jaxdp.engine.sched.rows import SAMPLING_FIELDS, sampling_row
from jaxdp.engine.step.controls import (
    FILL_CHUNK,
    bitmask_words,
    counted,
    fill_slots,
    prepare,
    sample_with_controls,
)
from jaxdp.engine.step.sampling import sample_tokens
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.mtp import MTPLayer
from jaxdp.one_batch import run_prompts
from jaxdp.parallel.step import StepRunner
from jaxdp.testing import HostOnlyRunner

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


def test_penalties_and_logit_bias_reach_the_sampling_params():
    """frequency_penalty, presence_penalty, repetition_penalty and logit_bias (OpenAI endpoints and SGLang's
    sampling_params alike) reach the request as sent (logit_bias's JSON keys as token ids); what cannot be served
    is one sentence."""
    body = {"frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.1, "logit_bias": {"50": -100}}
    p = openai_params(Ctx(), {"max_tokens": 8, **body}, 16)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.logit_bias) == (0.5, -1, 1.1, {50: -100.0})
    sps, _, _ = native_params(Ctx(), {"sampling_params": {"max_new_tokens": 8, **body}}, 1)
    assert (sps[0].frequency_penalty, sps[0].repetition_penalty, sps[0].logit_bias) == (0.5, 1.1, {50: -100.0})
    with pytest.raises(BadRequest, match=r"^presence_penalty must be a number in \[-2, 2\], got 'x'$"):
        openai_params(Ctx(), {"presence_penalty": "x"}, 16)
    with pytest.raises(BadRequest, match=r"^logit_bias keys must be token ids \(integers\), got 'a'$"):
        native_params(Ctx(), {"sampling_params": {"logit_bias": {"a": 1}}}, 1)


def test_a_rows_ban_holds_its_eos_and_stop_ids_unless_it_ignores_eos():
    params = SamplingParams(min_new_tokens=2, stop_token_ids=[9, 4])
    floor, ban = sampling_row(params, "r", 0, V, eos_token_ids=(4, 1))[5:7]
    assert floor == 2 and ban.shape == (BAN_WIDTH,) and ban[:4].tolist() == [9, 4, 1, -1] and (ban[3:] == -1).all()
    ban = sampling_row(SamplingParams(min_new_tokens=2, stop_token_ids=[9], ignore_eos=True), "r", 0, V, (4,))[6]
    assert ban[:2].tolist() == [9, -1]
    floor, ban = sampling_row(SamplingParams(stop_token_ids=[9]), "r", 0, V, (4,))[5:7]
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
    np.testing.assert_allclose(np.asarray(logprobs[0]), np.asarray(want), rtol=1e-5, atol=1e-5)
    plain, _ = sample_tokens(logits, t, ones, jnp.full((1, 4), -1, jnp.int32), zeros, keys)
    assert plain[0].tolist() == [7, 7, 7, 7]  # (without the floors)


def test_the_controls_match_the_numpy_reference_row_by_row():
    """A slot filled from a prompt and an output (`fill_slots`), tokens counted after sampling (`counted`), and the
    logits `prepare` hands the sampler, against `reference_logits` per row: rows with a bias, penalties, a grammar,
    all of them, none. The sampler chooses from them and reports the unmodified log-probabilities."""
    rng = np.random.default_rng(0)
    R, B, P = 2, 4, 3
    logits = rng.normal(0, 3, (R, B, V)).astype(np.float32)
    prompt = {(r, b): rng.integers(0, V, 10).tolist() for r in range(R) for b in range(B)}
    out = {k: rng.integers(0, 40, 12).tolist() for k in prompt}  # (repeats: counts above 1)
    params = [SamplingParams(), SamplingParams(logit_bias={5: 30.0, 6: -100.0}),
              SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, repetition_penalty=1.6),
              SamplingParams(frequency_penalty=2.0, repetition_penalty=0.5, logit_bias={out[0, 3][0]: 3.0},
                             grammar=fake_grammar(list(range(0, V, 7)), 1))]
    counts, seen = jnp.zeros((R, P, V), jnp.int32), jnp.zeros((R, P, V), bool)
    slots = np.asarray([[-1, -1, 2, 0], [-1, -1, 0, 1]], np.int32)
    for b in (2, 3):  # fill each penalised row's slot: prompt then output (the output minus its last token)
        for reset, ids, is_out in ((True, prompt, False), (False, out, True)):
            chunk = np.full((R, FILL_CHUNK), -1, np.int32)
            for r in range(R):
                toks = ids[r, b][:-1] if is_out else ids[r, b]
                chunk[r, : len(toks)] = toks
            counts, seen = fill_slots(counts, seen, jnp.asarray(slots[:, b]), jnp.full(R, reset),
                                      jnp.asarray(chunk), jnp.full((R, FILL_CHUNK), is_out))
    last = np.asarray([[out[r, b][-1] for b in range(B)] for r in range(R)], np.int32)
    counts = counted(counts, jnp.asarray(slots), jnp.asarray(last))  # (the last output token, as after sampling)
    rows = [sampling_row(params[b], "r", 0, V, (), slots[r, b]) for r in range(R) for b in range(B)]
    host = {k: np.stack([row[i] for row in rows]).reshape(R, B, *np.shape(rows[0][i]))
            for i, k in enumerate(SAMPLING_FIELDS) if k in CONTROL_KEYS}
    mask = np.full((R, B, bitmask_words(V)), -1, np.int32)
    FakeMatcher(json.loads(params[3].grammar.text)["allowed"], 1).fill(mask[0, 3])
    FakeMatcher(json.loads(params[3].grammar.text)["allowed"], 1).fill(mask[1, 3])
    got = np.asarray(prepare(jnp.asarray(logits), *(jnp.asarray(host[k]) for k in CONTROL_KEYS), counts, seen,
                             jnp.asarray(mask)))
    for r in range(R):
        for b in range(B):
            pen = slots[r, b] >= 0
            want = reference_logits(logits[r, b], prompt[r, b] if pen else [], out[r, b] if pen else [], params[b])
            np.testing.assert_allclose(got[r, b], want, rtol=1e-5, atol=1e-4, err_msg=f"row {r}, {b}")
    t = jnp.zeros((R, B))
    before = np.asarray(counts)
    tokens, logprobs, counts = sample_with_controls(  # (greedy rows, no floor; the step's compiled function)
        jnp.asarray(logits), t, t + 1, jnp.full((R, B), -1), t, jnp.zeros((R, B, 2), jnp.uint32), jnp.zeros((R, B),
        jnp.int32), jnp.full((R, B, BAN_WIDTH), -1), *(jnp.asarray(host[k]) for k in CONTROL_KEYS), counts, seen,
        jnp.asarray(mask), width=B)
    assert (np.asarray(tokens) == got.argmax(-1)).all()
    added = np.asarray(counts) - before  # (each penalised row's token counted in its slot, nothing else)
    assert added.sum() == (slots >= 0).sum() and all(added[r, slots[r, b], int(tokens[r, b])] == 1
                                                    for r in range(R) for b in range(B) if slots[r, b] >= 0)
    raw = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    np.testing.assert_allclose(np.asarray(logprobs), np.take_along_axis(np.asarray(raw), np.asarray(tokens)[..., None],
                                                                        -1)[..., 0], rtol=1e-5, atol=1e-5)


def test_penalties_bias_and_grammars_are_checked_and_refused_in_one_sentence():
    with pytest.raises(BadRequest, match=r"^frequency_penalty must be a number in \[-2, 2\], got 3$"):
        SamplingParams(frequency_penalty=3).validate()
    with pytest.raises(BadRequest, match=r"^repetition_penalty must be a number in \(0, 2\], got 0$"):
        SamplingParams(repetition_penalty=0).validate()
    with pytest.raises(BadRequest, match=r"^logit_bias values must be numbers in \[-100, 100\], got 101 for token 3$"):
        SamplingParams(logit_bias={"3": 101}).validate()
    with pytest.raises(BadRequest, match=r"^logit_bias holds 301 entries, more than the 300 allowed; send fewer$"):
        SamplingParams(logit_bias={i: 1 for i in range(301)}).validate()
    assert SamplingParams(logit_bias={"7": 2}).validate().logit_bias == {7: 2.0}  # (JSON's keys are strings)
    eng = Engine(HostOnlyRunner("tiny", "dp=1", 32, 4), config=EngineConfig(max_running_requests=4), warmup=False)
    try:
        with pytest.raises(BadRequest, match=r"^logit_bias holds token id 512, outside the vocabulary \(0..511\)$"):
            eng.make_request([1, 2], SamplingParams(logit_bias={512: 1.0}))
        with pytest.raises(BadRequest, match=r"^this server serves no grammars \(--grammar-backend none, "):
            eng.make_request([1, 2], SamplingParams(grammar=GrammarSpec("regex", "a+")))
    finally:
        eng.shutdown()


class HeldGrammars:
    """A grammar backend whose futures the test completes: "bad" fails, anything else waits for `release`."""

    def __init__(self):
        self.futures: list[concurrent.futures.Future] = []

    def start(self, spec: GrammarSpec) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if spec.text == "bad":
            fut.set_exception(ValueError("the grammar does not compile"))
        self.futures.append(fut)
        return fut

    def release(self, matcher) -> None:
        for fut in self.futures:
            if not fut.done():
                fut.set_result(matcher)


def test_a_grammar_request_waits_for_its_matcher_and_penalties_for_a_slot(monkeypatch):
    """The scheduler admits a request with a grammar once its matcher is compiled (others run meanwhile), ends
    one whose grammar failed with the reason, and admits requests with penalties as penalty slots free up (each
    slot back once its request leaves). The device step is a stand-in: every sampled token is 1."""
    monkeypatch.setattr(loop_module, "PENALTY_SLOTS", 2)
    grammars = HeldGrammars()
    eng = Engine(HostOnlyRunner("tiny", "dp=1", 64, 4), config=EngineConfig(max_running_requests=4), warmup=False,
                 grammars=grammars)
    try:
        held = eng.submit(eng.make_request([5, 6, 7], SamplingParams(max_new_tokens=6, grammar=fake_grammar([1], 3))))
        bad = eng.submit(eng.make_request([5, 6], SamplingParams(grammar=GrammarSpec("regex", "bad"))))
        free = eng.submit(eng.make_request([5, 6], SamplingParams(max_new_tokens=3)))
        for _ in range(6):
            eng.step()
        assert free.finished and bad.finish_reason == "abort" and "the grammar does not compile" in bad.error
        assert not held.output_ids and not held.finished  # (its matcher is not ready: not admitted)
        grammars.release(FakeMatcher([1], 3))
        eng.run_until_idle()
        assert (held.output_ids, held.finish_reason) == ([1, 1, 1], "stop")  # (the grammar's end stops it)
        sched = eng.schedulers[0]
        pen = [eng.submit(eng.make_request([5, 6], SamplingParams(max_new_tokens=4, presence_penalty=1.0)))
               for _ in range(4)]
        most = 0
        while eng.step():
            most = max(most, len(sched.running))
            assert len(sched.free_slots) + sum(r.penalty_slot >= 0 for r in pen) == 2
        assert most == 2 and all(r.finish_reason == "length" for r in pen) and sorted(sched.free_slots) == [0, 1]
    finally:
        eng.shutdown()


def small_config(dp: int) -> EngineConfig:
    """Per rank: 8 requests, prompt chunks of 16 (test_engine's sizes)."""
    return EngineConfig(page_size=4, num_pages=64, max_running_requests=8 * dp, chunked_prefill_size=16 * dp,
                        decode_buckets=[1, 2, 4, 8], extend_buckets=[8, 16], max_len_extend_rows=8)


class FakeMatcher:
    """A grammar that allows only the tokens `allowed` and ends after `n` of them."""

    def __init__(self, allowed: list[int], n: int):
        self.allowed, self.n, self.k = set(allowed), n, 0

    def fill(self, bitmask_W: np.ndarray) -> None:
        words = np.zeros(bitmask_W.shape, np.uint32)
        for t in self.allowed:
            words[t // 32] |= np.uint32(1 << (t % 32))
        bitmask_W[:] = words.view(np.int32)

    def accept(self, token: int) -> bool:
        self.k += token in self.allowed
        return token in self.allowed

    def terminated(self) -> bool:
        return self.k >= self.n

    def reset(self) -> None:
        self.k = 0


class FakeGrammars:
    """A grammar backend whose grammar text is {"allowed": [...], "n": N}, compiled on a thread of its own."""

    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def start(self, spec: GrammarSpec) -> concurrent.futures.Future:
        return self.pool.submit(lambda: FakeMatcher(**json.loads(spec.text)))


def fake_grammar(allowed: list[int], n: int) -> GrammarSpec:
    return GrammarSpec("regex", json.dumps({"allowed": allowed, "n": n}))


def reference_logits(logits_V: np.ndarray, prompt: list[int], out: list[int], p: SamplingParams) -> np.ndarray:
    """The logits a row chooses from, in numpy (float64): logit bias, repetition penalty over prompt and output,
    frequency and presence penalties over the output, the grammar's allowed tokens."""
    x = logits_V.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.asarray(out, np.int64), minlength=len(x))
    seen = np.zeros(len(x), bool)
    seen[prompt] = True
    hit = seen | (counts > 0)
    r = p.repetition_penalty
    x = np.where(hit, np.where(x > 0, x / r, x * r), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if p.grammar is not None:
        allowed = np.zeros(len(x), bool)
        allowed[json.loads(p.grammar.text)["allowed"]] = True
        x = np.where(allowed, x, -np.inf)
    return x


def check_against_reference(runner, prompts: list[list[int]], reqs: list[Request]) -> None:
    """Each request's greedy tokens are, position by position, the best of the reference's logits over the
    model's teacher-forced logits of its prompt and output so far (every prompt read in one step, one device)."""
    ctx = [p + r.output_ids[:-1] for p, r in zip(prompts, reqs, strict=True)]
    logits = run_prompts(runner, ctx, [0] * len(ctx), 0)["prompt"]
    for p, r, L in zip(prompts, reqs, logits, strict=True):
        for k, tok in enumerate(r.output_ids):
            x = reference_logits(L[len(p) - 1 + k], p, r.output_ids[:k], r.params)
            assert x[tok] >= x.max() - 1e-3, (r.rid, k, tok, int(x.argmax()))


CONTROLLED = [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(repetition_penalty=1.8),
              dict(frequency_penalty=-0.5, repetition_penalty=1.3, logit_bias={3: 2.5}), None]


def controlled_params(i: int, first: int) -> SamplingParams:
    """Request i's controls: penalties, a logit bias that holds its unconstrained first token off, or a grammar of
    a few tokens that ends after 5 of them (max_new_tokens 8: it stops; request 7's 4: the length ends it)."""
    kind = CONTROLLED[i % 4]
    if kind is not None:
        return SamplingParams(max_new_tokens=8, temperature=0, **kind)
    if i % 8 == 3:
        return SamplingParams(max_new_tokens=8, temperature=0, logit_bias={first: -100.0, 17: 1.0})
    allowed = [first, *range(100, 140, 3)]
    return SamplingParams(max_new_tokens=4 if i == 7 else 8, temperature=0, grammar=fake_grammar(allowed, 5))


def run_layout(mesh_spec: str) -> list[tuple[list[int], str]]:
    """Prompts on ranks 0..7 (folded onto the layout's ranks), each decoded greedily twice: with a stop id at the
    token it would start with (it ends at once), and with that stop id held off for 4 tokens, beside rows
    without a floor; then with sampling controls (`controlled_params`) beside the same prompts unconstrained,
    whose tokens stay the greedy ones. On one device the controlled tokens are checked against the reference."""
    prompts = [np.random.default_rng(i).integers(0, V, 6 + i).tolist() for i in range(8)]
    with jax.default_matmul_precision("highest"):
        dp = parse_mesh_spec(mesh_spec).dp
        eng = Engine("tiny", mesh_spec, small_config(dp), seed=0, grammars=FakeGrammars())
        try:
            ranks = [i % dp for i in range(8)]
            greedy = SamplingParams(max_new_tokens=8, temperature=0)
            plain = eng.generate(prompts, greedy, ranks=ranks)
            firsts = [r.output_ids[0] for r in plain]
            compiles = eng.stats.compiles_in_steps
            params = [SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=[f],
                                     min_new_tokens=4 if i % 2 == 0 else 0) for i, f in enumerate(firsts)]
            reqs = eng.generate(prompts, params, ranks=ranks)
            controlled = [controlled_params(i, f) for i, f in enumerate(firsts)]
            both = eng.generate(prompts + prompts, controlled + [greedy] * 8, ranks=ranks + ranks)
            assert eng.stats.compiles_in_steps == compiles == 0  # compiled at start-up
            assert [r.output_ids for r in both[8:]] == [r.output_ids for r in plain]  # (theirs unchanged)
            if dp == 1 and parse_mesh_spec(mesh_spec).world == 1:
                check_against_reference(eng.runner, prompts, both[:8])
        finally:
            eng.shutdown()
    for i, (req, p) in enumerate(zip(both[:8], controlled, strict=True)):
        if p.grammar is not None:  # only its tokens; its end stops it, or the length first
            assert set(req.output_ids) <= set(json.loads(p.grammar.text)["allowed"])
            assert (len(req.output_ids), req.finish_reason) == ((4, "length") if i == 7 else (5, "stop"))
        elif p.logit_bias and p.logit_bias.get(firsts[i]) == -100:
            assert req.output_ids[0] != firsts[i]
    assert any(c.output_ids != g.output_ids for c, g in zip(both[:8], plain, strict=True) if c.params.has_penalties)
    for i, (req, first) in enumerate(zip(reqs, firsts, strict=True)):
        if i % 2:  # no floor: its stop id ends it at once
            assert req.output_ids == [first] and req.finish_reason == "stop"
        else:
            assert first not in req.output_ids[:4] and len(req.output_ids) >= 4, (i, req.output_ids)
            assert req.finish_reason == ("stop" if first in req.output_ids else "length")
    return [(r.output_ids, r.finish_reason) for r in reqs + both[:8]]


def test_sampling_controls_give_the_same_greedy_tokens_under_dp8_as_one_device():
    assert run_layout("dp=8") == run_layout("dp=1")


@pytest.mark.slow
def test_sampling_controls_give_the_same_greedy_tokens_under_tp8_as_one_device():
    """tp=8 splits the vocabulary of the LM head: the ban, the bias, the penalties and the bitmask apply to the
    gathered logits all the same."""
    assert run_layout("tp=8") == run_layout("dp=1")


@pytest.mark.slow
def test_sampling_controls_give_the_same_greedy_tokens_under_dp8_ep_as_one_device():
    """dp=8 with the experts spread over the 8 devices (moe=ep): the same tokens as one device."""
    assert run_layout("dp=8,moe=ep") == run_layout("dp=1")


def test_a_speculating_server_takes_the_sampling_controls():
    """A speculating server's verify applies min_tokens, the penalties and logit_bias (tests/test_spec_controls.py)
    and a grammar (tests/test_spec_grammar.py): none is refused for the speculation; an engine without a grammar
    backend refuses a grammar for that reason alone."""
    cfg = get_config("tiny")
    lay = parse_mesh_spec("dp=1")
    runner = StepRunner(DeepseekV3(cfg, nnx.Rngs(0)), lay, lay.make_mesh(jax.devices()[:1]), num_pages=32,
                        page_size=8, draft=MTPLayer(cfg, nnx.Rngs(1)))
    eng = Engine(runner, config=EngineConfig(max_running_requests=4, speculative=SpeculativeConfig(),
                                             disable_cuda_graph=True))
    try:
        with pytest.raises(BadRequest, match=r"^this server serves no grammars \(--grammar-backend none"):
            eng.make_request([1, 2, 3], SamplingParams(grammar=GrammarSpec("regex", "a")))
        for params in (SamplingParams(min_new_tokens=2), SamplingParams(repetition_penalty=1.2, presence_penalty=1),
                       SamplingParams(logit_bias={1: 1.0})):
            assert eng.make_request([1, 2, 3], params).params == params.validate()
    finally:
        eng.shutdown()
