"""Speculative decoding (MTP, topk 1) in the engine (`jaxdp.engine.step.spec`, `jaxdp.parallel.spec_step`): greedy
outputs identical with and without speculation, under DP attention with idle and unequal ranks, tensor
parallelism, expert parallelism, prefix-cache hits, chunked prompts and retraction; no compile while serving;
sampled requests reproducible by seed; what cannot be served refused in one sentence.

The model is the tiny preset made predictable enough that drafts are partly accepted (a verify then keeps some
drafts and rejects the rest, the case that moves KV slots and positions): its layers' outputs are scaled down,
so the next token is mostly a function of the current one, and the MTP layer is rigged to compute that function
(its eh_proj takes the embedding half, its decoder layer adds nothing). Attention and the experts still change
the target's choice often enough that acceptance stays well below the maximum: any wrong KV row, position or
expert row of a verify changes the tokens against the plain engine's.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.config import get_config
from jaxdp.engine.loop import Engine
from jaxdp.engine.options import EngineConfig, SpeculativeConfig
from jaxdp.engine.sched.request import BadRequest, SamplingParams
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.mtp import MTPLayer
from jaxdp.parallel.step import StepRunner

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0)
PAGE = 8


def rigged(alpha: float = 0.3, beta: float = 0.3, seed: int = 0):
    """(target, MTP layer) of the tiny preset, the target's layers scaled by alpha (attention) and beta (FFN),
    the MTP layer predicting the target's next token from the token alone."""
    cfg = get_config("tiny")
    model, mtp = DeepseekV3(cfg, nnx.Rngs(seed)), MTPLayer(cfg, nnx.Rngs(seed + 1))
    for stack in (model.dense_layers, model.moe_layers):
        stack.attn.w_o_HVD[...] = stack.attn.w_o_HVD[...] * alpha
        if stack is model.moe_layers:
            stack.ffn.w_down_EID[...] = stack.ffn.w_down_EID[...] * beta
            stack.ffn.shared.w_down_FD[...] = stack.ffn.shared.w_down_FD[...] * beta
        else:
            stack.ffn.w_down_FD[...] = stack.ffn.w_down_FD[...] * beta
    D = cfg.hidden_size
    mtp.w_eh_XD[...] = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))])
    layer = mtp.moe_layers
    for w in (layer.attn.w_o_HVD, layer.ffn.w_down_EID, layer.ffn.shared.w_down_FD):
        w[...] = jnp.zeros_like(w[...])
    return model, mtp


def prompts(n: int, seed: int = 0, prefix: list[int] | None = None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [(prefix or []) + rng.integers(3, 500, size=int(rng.integers(2, 40))).tolist() for _ in range(n)]


def engine(runner, spec: bool, **cfg) -> Engine:
    off_above = cfg.pop("spec_off_above", None)
    config = EngineConfig(max_running_requests=cfg.pop("max_running_requests", 16), chunked_prefill_size=64,
                          extend_buckets=cfg.pop("extend_buckets", [16, 32, 64, 128]),
                          speculative=SpeculativeConfig(disable_by_batch_size=off_above) if spec else None, **cfg)
    return Engine(runner, config=config)


@pytest.fixture(scope="module")
def models():
    return rigged()


def runner_for(models, mesh_spec: str, num_pages: int = 128) -> StepRunner:
    lay = parse_mesh_spec(mesh_spec)
    model, mtp = models
    return StepRunner(model, lay, lay.make_mesh(jax.devices()[: lay.world]), num_pages=num_pages, page_size=PAGE,
                      draft=mtp)


def check_same_greedy(runner, batches, ranks=None, warm=False, params=GREEDY, **cfg):
    """Each batch of prompts through a plain engine, then through a speculating one on the same runner: the
    same tokens. Returns the speculating engine and its requests. `warm`: the speculating engine compiles its
    steps at start-up and no step compiles while serving (otherwise both compile what they use, on first use)."""
    outs = []
    for spec in (False, True):
        e = engine(runner, spec, disable_cuda_graph=not (spec and warm), **cfg)
        reqs = [r for b, batch in enumerate(batches) for r in e.generate(batch, params, ranks=ranks and ranks[b])]
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]
    if warm:
        assert e.stats.compiles_in_steps == 0
    return e, reqs


@pytest.mark.parametrize("mesh_spec", ["dp=8", "dp=2,tp=4"])
def test_greedy_tokens_are_the_plain_engines_under_dp_attention(models, mesh_spec):
    """Two waves sharing a 24-token prefix (the second reads it from the prefix cache), prompts up to 63 tokens
    read in chunks of 64 / dp per rank; under dp=8 the first wave is pinned to ranks 0, 2, 2, 2, 2, 2, 4, 4, 4
    (ranks 1, 3, 5, 6, 7 run idle steps beside them)."""
    prefix = list(range(100, 124))
    waves = [prompts(9, 1, prefix), prompts(8, 2, prefix)]
    ranks = [[0, 2, 2, 2, 2, 2, 4, 4, 4], None] if mesh_spec == "dp=8" else None
    # (dp=8 compiles every shape at start-up: a rank's rows never pass 8 there, so one extend bucket serves all)
    e, reqs = check_same_greedy(runner_for(models, mesh_spec), waves, ranks, warm=mesh_spec == "dp=8",
                                **({"extend_buckets": [16]} if mesh_spec == "dp=8" else {}))
    assert sum(r.cached_tokens for r in reqs[9:]) >= 2 * 24  # the second wave hit the prefix cache
    states = [s.state() for s in e.schedulers]
    busy = [s for s in states if s["spec_accept_length"]]
    assert busy and all(1.2 < s["spec_accept_length"] < 3.9 for s in busy), states  # partly accepted
    assert all(r.spec_verify_ct > 0 for r in reqs)
    assert all(r.spec_accepted + r.spec_verify_ct + 1 >= len(r.output_ids) for r in reqs)
    for s in e.schedulers:  # every page back to the pool or the prefix cache
        assert s.pool.free + s.cache.evictable() == s.pool.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["tp=8", "dp=8,moe=ep", "dp=4,tp=2,moe=ep"])
def test_greedy_tokens_are_the_plain_engines_under_tp_and_ep(models, mesh_spec):
    check_same_greedy(runner_for(models, mesh_spec), [prompts(12, 3)])


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow)])  # (CI: the default)
def test_speculation_switched_off_above_a_batch_size_keeps_the_greedy_tokens(models, overlap):
    """--speculative-disable-by-batch-size 5 under dp=2 with 12 requests (up to 8 a rank): the first step reads
    prompts speculatively; while more than 5 are held a plain stretch runs (the other prompts read plainly, plain
    decode steps, queued with the last one in flight unless --disable-overlap-schedule), and as requests finish the
    first ones (the longest) speculate again, their MTP layer drafting anew; the tokens are the plain engine's all
    along, and nothing compiles while serving."""
    runner = runner_for(models, "dp=2")
    spec_engine = Engine.__init__
    queued_in_flight = []

    def watched(self, *args, **kwargs):  # each plain step: was the last one still in flight when it was queued?
        spec_engine(self, *args, **kwargs)
        queue = self.pipeline._queue

        def _queue(plans, shape, *rest):
            if self.pipeline.switch is not None and self.pipeline.switch.plain:  # (the plain engine: no stretches)
                queued_in_flight.append(self.pipeline.inflight is not None)
            return queue(plans, shape, *rest)
        self.pipeline._queue = _queue

    Engine.__init__ = watched
    try:  # (every shape compiled at start-up: a rank's rows never pass 32, so extend buckets 64, 128 go unused)
        long = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.0)
        e, reqs = check_same_greedy(runner, [prompts(12, 6)], warm=True, spec_off_above=5, extend_buckets=[16, 32],
                                    overlap=overlap, params=[long] * 4 + [GREEDY] * 8)
    finally:
        Engine.__init__ = spec_engine
    kinds = [r.kind for r in e.pipeline.stats.records]
    assert kinds.count("decode") >= 3 and kinds.count("spec") >= 3, kinds
    assert any(queued_in_flight) == overlap and len(queued_in_flight) >= 3, queued_in_flight
    assert any(r.spec_verify_ct > 0 for r in reqs[:4]) and all(r.spec_verify_ct == 0 for r in reqs[6:])
    for s in e.schedulers:
        assert s.pool.free + s.cache.evictable() == s.pool.num_pages


def test_a_stretch_goes_on_while_no_request_drafts_and_a_new_request_still_speculates(models):
    """Off above 5 under dp=2: 8 short requests start a stretch, 4 long ones arrive in it (read plainly, they never
    draft); once the short ones are done the 4 run on in a quiet stretch (plain decode steps of 4 requests, not
    verifies that draft nothing), and a request arriving then waits a step, is read speculatively and drafts.
    Every token is the plain engine's."""
    runner = runner_for(models, "dp=2")
    short, long = (SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0) for n in (12, 48))
    outs = []
    for spec in (False, True):
        e = engine(runner, spec, spec_off_above=5 if spec else None)
        submit = [e.submit(e.make_request(p, sp)) for p, sp in ((p, short) for p in prompts(8, 7))]
        e.run_until_idle(max_steps=2)
        late = [e.submit(e.make_request(p, long)) for p in prompts(4, 8)]
        while not all(r.finished for r in submit):
            e.step()
        e.run_until_idle(max_steps=4)
        last = e.submit(e.make_request(prompts(1, 9)[0], GREEDY))
        e.run_until_idle()
        reqs = [*submit, *late, last]
        assert all(r.finished for r in reqs)
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]
    assert all(r.spec_verify_ct == 0 for r in late) and last.spec_verify_ct > 0
    quiet = [r for r in e.pipeline.stats.records if r.kind == "decode" and sum(r.rows) <= 5]
    assert len(quiet) >= 10, [(r.kind, r.rows) for r in e.pipeline.stats.records]
    draftless = [r for r in e.pipeline.stats.records if r.kind == "spec" and sum(r.rows) == 4]
    assert len(draftless) <= 1, [(r.kind, r.rows) for r in e.pipeline.stats.records]  # (the first: not yet known)
    # a quiet stretch whose requests all finished as its last step was booked: the request that arrives then is
    # held back a pass in which nothing runs, and run_until_idle must not stop there
    e.pipeline.switch.plain = e.pipeline.switch.quiet = True
    again = e.submit(e.make_request(prompts(1, 10)[0], GREEDY))
    e.run_until_idle()
    assert again.finished and again.spec_verify_ct > 0


def test_retraction_and_a_small_pool_keep_the_greedy_tokens(models):
    """A pool of 10 pages of 8 tokens a rank for 8 requests a rank growing to 60 tokens: requests are retracted
    and read again, and still get the plain engine's tokens."""
    runner = runner_for(models, "dp=2", num_pages=10)
    e, reqs = check_same_greedy(runner, [prompts(16, 4)])
    assert sum(s.retracted_total for s in e.schedulers) > 0


def test_sampling_is_reproducible_by_seed_and_refusals_are_sentences(models):
    runner = runner_for(models, "dp=2")
    e = engine(runner, True, disable_cuda_graph=True)
    sampled = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    batch = prompts(6, 5)
    first = [r.output_ids for r in e.generate(batch, sampled)]
    again = [r.output_ids for r in e.generate(batch, sampled)]
    assert first == again and all(len(t) == 16 and all(0 <= x < 512 for x in t) for t in first)
    with pytest.raises(BadRequest, match="decodes speculatively"):
        e.make_request([1, 2, 3], SamplingParams(top_logprobs=2))
    with pytest.raises(ValueError, match="--enable-mixed-chunk cannot serve with --speculative-algorithm"):
        engine(runner, True, enable_mixed_chunk=True)
    lay = parse_mesh_spec("dp=2")
    plain = StepRunner(models[0], lay, lay.make_mesh(jax.devices()[:2]), num_pages=16, page_size=PAGE)
    with pytest.raises(ValueError, match="needs the model's MTP layer"):
        engine(plain, True)


@pytest.mark.parametrize("argv, words", [
    (["--speculative-num-steps", "2"], "--speculative-num-steps needs --speculative-algorithm"),
    (["--speculative-algorithm", "MEDUSA"], "'MEDUSA' is not one of EAGLE, NEXTN"),
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"], "only a chain (topk 1)"),
    (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "5"],
     "use --speculative-num-draft-tokens 3"),
    (["--speculative-disable-by-batch-size", "8"], "--speculative-disable-by-batch-size needs --speculative-algorithm"),
    (["--speculative-algorithm", "EAGLE", "--speculative-disable-by-batch-size", "0"],
     "--speculative-disable-by-batch-size must be at least 1, got 0"),
])
def test_speculative_flags_refused_in_one_sentence(argv, words):
    from jaxdp.serve import UserError, build_parser, engine_config

    with pytest.raises(UserError, match=re.escape(words)):
        engine_config(build_parser().parse_args(argv), 64)


def test_speculative_flags_take_sglangs_defaults_and_a_checkpoint_without_mtp_is_refused(tmp_path):
    from jaxdp.layout import parse_mesh_spec as parse
    from jaxdp.model.loader import save_hf_checkpoint
    from jaxdp.serve import UserError, build_parser, engine_config, serve_config

    spec = engine_config(build_parser().parse_args(["--speculative-algorithm", "nextn"]), 64).speculative
    assert (spec.algorithm, spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == ("NEXTN", 3, 1, 4)
    assert spec.disable_by_batch_size is None
    argv = ["--speculative-algorithm", "EAGLE", "--speculative-disable-by-batch-size", "48"]
    assert engine_config(build_parser().parse_args(argv), 64).speculative.disable_by_batch_size == 48
    save_hf_checkpoint(DeepseekV3(get_config("tiny"), nnx.Rngs(0)), tmp_path)
    args = build_parser().parse_args(["--model-path", str(tmp_path), "--speculative-algorithm", "EAGLE"])
    with pytest.raises(UserError, match="no MTP layer 0; use a checkpoint that ships its MTP"):
        serve_config(args, parse("dp=1"))
    args = build_parser().parse_args(["--speculative-algorithm", "EAGLE", "--enable-mixed-chunk"])
    with pytest.raises(UserError, match="--enable-mixed-chunk cannot serve with --speculative-algorithm"):
        serve_config(args, parse("dp=1"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["dp=8", "tp=8", "dp=2,tp=4", "dp=8,moe=ep"])
def test_the_default_model_speculating_gives_its_greedy_tokens(mesh_spec):
    """200 held-out problems of every skill (the long ones among them) on the embedded default model, whose MTP
    layer drafts for real: the tokens without and with speculation are the same, and drafts are accepted."""
    from jaxdp.model.loader import default_model_path
    from jaxdp.tokenizer import Tokenizer
    from jaxdp.training.data import SKILLS, sample_problem

    tok = Tokenizer.from_dir(default_model_path())
    rng = np.random.default_rng(0)
    batch = [tok.encode(sample_problem(rng, SKILLS[i % len(SKILLS)], held_out=True).prompt) for i in range(200)]
    params = SamplingParams(max_new_tokens=72, temperature=0.0)
    outs, accept = [], []
    for spec in (None, SpeculativeConfig()):
        config = EngineConfig(max_running_requests=64, chunked_prefill_size=256, speculative=spec,
                              disable_cuda_graph=True)
        e = Engine("default", mesh_spec, config, dtype="float32")
        outs.append([r.output_ids for r in e.generate(batch, params)])
        accept = [s.state().get("spec_accept_length", 0.0) for s in e.schedulers]
    assert outs[0] == outs[1]
    assert max(accept) > 1.5, accept
