"""Sampling controls inside the verify step (`jaxdp.engine.step.controls.prepare_verify`, `counted_verify`): each of a
request's D + 1 positions chooses from the logits plain decoding would have chosen from had the drafts before it
been accepted (the logit bias; the penalties over the slot's counts plus those drafts; min_tokens' ban while the
tokens before it are under the floor), checked against a numpy reference that walks the drafts; only the tokens a
request gets are counted into its slot. On the embedded default model (whose MTP layer drafts for real) the greedy
tokens of requests with penalties, a logit bias or a min_tokens floor are the same with and without
--speculative-algorithm EAGLE, on one device and under dp=8 (tp=8 and dp=8 with EP: the slow set)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.batch import CONTROL_KEYS
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.options import SpeculativeConfig
from jaxdp.engine.sched.request import BAN_WIDTH
from jaxdp.engine.sched.rows import SAMPLING_FIELDS, sampling_row
from jaxdp.engine.step.controls import counted_verify, prepare_verify
from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import sample_problem
from tests.test_sampling_controls import reference_logits
from tests.test_spec_decode import check_same_greedy, prompts, rigged, runner_for

V = 512


def verify_case(seed: int = 0):
    """Six requests of a verify with D = 3 drafts, their prompts, outputs so far, drafts (with repeats, and drafts
    that repeat output tokens) and controls: none, a bias, penalties (two kinds), all of them with a floor, and a
    prompt's first token (no drafts offered) with penalties and a floor."""
    rng = np.random.default_rng(seed)
    B, D, P = 6, 3, 8
    prompt = [rng.integers(0, V, 9).tolist() for _ in range(B)]
    out = [rng.integers(0, 30, 7).tolist() for _ in range(B)]
    out[5] = []  # (its prompt's last chunk: nothing generated yet)
    drafts = [[out[b][0], out[b][0], int(rng.integers(0, 30))] if out[b] else [0, 0, 0] for b in range(B)]
    drafts[2] = [prompt[2][0], 40, 40]  # (a prompt token drafted: its repetition penalty applies from the start)
    n_draft = [D, D, D, D, D, 0]
    params = [SamplingParams(), SamplingParams(logit_bias={5: 30.0, drafts[1][0]: -2.0}),
              SamplingParams(frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(repetition_penalty=1.7, frequency_penalty=-0.6),
              SamplingParams(frequency_penalty=0.9, repetition_penalty=1.3, logit_bias={7: 4.0}, min_new_tokens=9,
                             stop_token_ids=[11, 12]),
              SamplingParams(presence_penalty=1.1, min_new_tokens=2, stop_token_ids=[3])]
    slots = [-1, -1, 4, 0, 7, 2]
    return B, D, P, prompt, out, drafts, n_draft, params, slots


def test_each_verify_position_sees_the_controls_plain_decoding_would():
    """`prepare_verify` against `reference_logits` at every position j (the output so far plus drafts 0..j-1, the
    eos / stop ids at -inf while n_out + j is under min_tokens); `counted_verify` adds exactly the tokens each live
    penalised request gets."""
    B, D, P, prompt, out, drafts, n_draft, params, slots = verify_case()
    J = D + 1
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (B, J, V)).astype(np.float32)
    counts, seen = np.zeros((P, V), np.int32), np.zeros((P, V), bool)
    for b, s in enumerate(slots):
        if s >= 0:
            np.add.at(counts[s], out[b], 1)
            seen[s, prompt[b]] = True
    eos = (2,)
    rows = [sampling_row(params[b], f"r{b}", 0, V, eos, slots[b]) for b in range(B)]
    host = {k: np.stack([row[i] for row in rows]) for i, k in enumerate(SAMPLING_FIELDS)}
    n_out = np.asarray([len(o) for o in out], np.int32)
    got = np.asarray(prepare_verify(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), jnp.asarray(n_draft),
                                    jnp.asarray(n_out), jnp.asarray(host["min_tokens"]), jnp.asarray(host["ban"]),
                                    *(jnp.asarray(host[k]) for k in CONTROL_KEYS), jnp.asarray(counts),
                                    jnp.asarray(seen)))
    assert host["ban"].shape == (B, BAN_WIDTH)
    for b in range(B):
        pen = slots[b] >= 0
        for j in range(J):
            before = out[b] + drafts[b][: min(j, n_draft[b])]  # the drafts before position j, as if accepted
            want = reference_logits(logits[b, j], prompt[b] if pen else [], before if pen else [], params[b])
            if len(out[b]) + j < params[b].min_new_tokens:
                want[[*params[b].stop_token_ids, *eos]] = -np.inf
            np.testing.assert_allclose(got[b, j], want, rtol=1e-5, atol=1e-4, err_msg=f"request {b}, position {j}")
    # the controls change the choice somewhere, and a draft counted at an earlier position changes a later one
    assert (got.argmax(-1) != logits.argmax(-1)).any()
    walked = [reference_logits(logits[3, j], prompt[3], out[3], params[3]) for j in range(J)]
    assert not np.allclose(got[3, 2], walked[2])

    tokens = np.asarray([[drafts[b][0], 9, -1, -1] for b in range(B)], np.int32)  # (one draft accepted, then 9)
    tokens[5] = [17, -1, -1, -1]  # (its first token)
    live = np.asarray([True] * 5 + [True])
    live[3] = False  # (a chunk that samples nothing: counted nowhere)
    new = np.asarray(counted_verify(jnp.asarray(counts), jnp.asarray(slots, jnp.int32), jnp.asarray(live),
                                    jnp.asarray(tokens)))
    want = counts.copy()
    for b, s in enumerate(slots):
        if s >= 0 and live[b]:
            np.add.at(want[s], tokens[b][tokens[b] >= 0], 1)
    assert (new == want).all() and (new != counts).any()


MAX_NEW = 32
SKILLS = ("long_sort", "long_sort", "long_sort", "add", "mul3", "long_reverse") + ("long_sort",) * 3 + (
    "add", "mul3", "long_sort")  # (request i gets kind i % 6)


def controls_of(i: int, plain: list[list[int]]) -> dict:
    """Request i's controls, each strong enough to change the default model's greedy tokens (the test asserts
    that each kind does for some request): penalties, a logit bias against its first plain token, a floor past
    its plain end (eos held off), all of them."""
    out = plain[i]
    return [dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(repetition_penalty=2.0),
            dict(logit_bias={out[0]: -100.0}), dict(min_new_tokens=min(len(out) + 3, MAX_NEW)),
            dict(frequency_penalty=0.5, repetition_penalty=1.5, logit_bias={out[1]: -100.0, 7: 1.0},
                 min_new_tokens=10)][i % 6]


def serve(mesh_spec: str, speculative: bool) -> dict:
    """The default model's greedy tokens of held-out problems, plain and with `controls_of`, and 4 sampled
    requests (temperature 1, seeded) with a logit bias of +100 on token 77; the speculating engine compiles its
    steps at start-up and nothing while serving."""
    tok = Tokenizer.from_dir(default_model_path())
    rng = np.random.default_rng(0)
    prompts = [tok.encode(sample_problem(rng, s, held_out=True).prompt) for s in SKILLS]
    dp = int(mesh_spec.split(",")[0][3:]) if mesh_spec.startswith("dp=") else 1
    # (4 requests a rank: 12 requests, 8 of them penalised, wait for penalty slots, which are freed and filled again)
    config = EngineConfig(max_running_requests=4 * dp, chunked_prefill_size=64 * dp, decode_buckets=[4],
                          extend_buckets=[64], context_length=128, disable_cuda_graph=not speculative,
                          speculative=SpeculativeConfig() if speculative else None)
    with jax.default_matmul_precision("highest"):
        e = Engine("default", mesh_spec, config, dtype="float32")
        try:
            greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
            plain = [r.output_ids for r in e.generate(prompts, greedy)]
            params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, **controls_of(i, plain))
                      for i in range(len(prompts))]
            controlled = e.generate(prompts, params)
            hot = e.generate(prompts[:4], [SamplingParams(max_new_tokens=8, temperature=1.0, seed=i,
                                                          logit_bias={77: 100.0}) for i in range(4)])
            if speculative:
                assert e.stats.compiles_in_steps == 0  # (the controls are inputs of the steps compiled at start-up)
                assert sum(r.spec_accepted for r in controlled) > len(prompts)  # (drafts accepted under controls)
        finally:
            e.shutdown()
    return {"plain": plain, "controlled": [(r.output_ids, r.finish_reason) for r in controlled], "params": params,
            "hot": [r.output_ids for r in hot]}


def check_same_with_and_without_speculation(mesh_spec: str) -> None:
    without, spec = serve(mesh_spec, False), serve(mesh_spec, True)
    assert spec["plain"] == without["plain"]
    assert spec["controlled"] == without["controlled"]
    assert spec["hot"] == without["hot"] == [[77] * 8] * 4  # (sampled rows choose from the biased distribution)
    changed = [out != plain for (out, _), plain in zip(without["controlled"], without["plain"], strict=True)]
    assert all(any(changed[k::6]) for k in range(6)), changed  # every kind of control changes some request's tokens
    for (out, _), p in zip(spec["controlled"], spec["params"], strict=True):
        assert len(out) >= p.min_new_tokens and 2 not in out[: p.min_new_tokens]  # (eos held off below the floor)


def test_controls_give_the_same_greedy_tokens_with_and_without_speculation():
    check_same_with_and_without_speculation("dp=1")


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["dp=8", "tp=8", "dp=2,tp=4", "dp=8,moe=ep"])
def test_controls_give_the_same_greedy_tokens_with_and_without_speculation_under_tp_and_ep(mesh_spec):
    check_same_with_and_without_speculation(mesh_spec)


@pytest.mark.slow
def test_penalty_slots_carry_across_plain_stretches_into_verifies():
    """--speculative-disable-by-batch-size 5 under dp=2 (the rigged tiny model of tests/test_spec_decode.py): the
    penalised requests read speculatively decode in a plain stretch (the plain steps count their tokens) and then
    verify again over the same penalty state; every request's greedy tokens are the plain engine's."""
    def params(i: int) -> SamplingParams:
        if i % 2 and i != 1:
            return SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0)
        return SamplingParams(max_new_tokens=40 if i < 4 else 20, ignore_eos=True, temperature=0.0,
                              frequency_penalty=1.5, repetition_penalty=1.3, logit_bias={5: 3.0}, min_new_tokens=4)

    _, reqs = check_same_greedy(runner_for(rigged(), "dp=2"), [prompts(12, 6)], spec_off_above=5,
                                extend_buckets=[16, 32], decode_buckets=[8], params=[params(i) for i in range(12)])
    assert reqs[0].spec_verify_ct > 0 and reqs[1].spec_verify_ct > 0  # (penalised, verified after the stretch)
