"""`--dcp-size` in the engine (issue 48 point 3, docs/dcp.md): under dp=2,tp=4 the pool split over the group's 4
devices answers the same greedy tokens as the unsplit pool (dcp=1), for a prompt read in chunks, a prefix-cache hit
and short prompts on both ranks; at the same memory per device the split pool holds 4 times the tokens; KV handed
over by a dcp=1 prefill engine is laid out in the split pool and answers the same, and the other way round. The
tp=8 variants (dcp 8 and 2) are slow. Bad sizes are refused in one sentence before anything loads."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.options import DisaggConfig
from jaxdp.engine.sched.request import Bootstrap
from jaxdp.model.loader import default_model_path
from jaxdp.net import free_port
from jaxdp.serve import build_parser
from jaxdp.serve_config import PoolSizing, UserError, pool_pages, serve_config

HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
needs_model = pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model (with its tokenizer) is absent")


def answers(mesh: str, dcp: int, num_pages: int = 32) -> dict:
    """Greedy tokens of a chunked 130-token prompt, a prompt sharing its first 128 tokens (a prefix-cache hit) and
    two short prompts, on both ranks; with the runner's pool and its sizing at the default memory fraction."""
    dp = int(mesh.split(",")[0].removeprefix("dp="))
    cfg = EngineConfig(page_size=16, num_pages=num_pages, max_running_requests=8, chunked_prefill_size=64,
                       decode_buckets=[8 // dp], extend_buckets=[64 // dp], disable_cuda_graph=True)  # (few shapes)
    eng = Engine("default", mesh, cfg, warmup=False, dcp_size=dcp)
    tok = eng.tokenizer

    def ids(text):
        e = tok.encode(text)
        return e if isinstance(e, list) else e.ids

    rng = np.random.default_rng(0)
    letters = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=120))
    long = ids(f"reverse {letters}=")
    sp = SamplingParams(max_new_tokens=8, temperature=0)
    first = eng.generate([long, ids("12+34="), ids(f"reverse {letters[:30]}=")], sp, ranks=[0, 1 % dp, 0])
    hit = eng.generate([long[:-1] + ids("x=")], sp, ranks=[0])[0]
    runner = eng.runner
    shard = runner.cache["moe"].addressable_shards[0].data
    out = {"tokens": [r.output_ids for r in first] + [hit.output_ids], "cached": hit.cached_tokens,
           "long": len(long), "tokens_per_group": runner.num_pages * runner.page_size,
           "bytes_per_device": sum(a.addressable_shards[0].data.nbytes for a in runner.cache.values()),
           "shard_shape": shard.shape, "sized_pages": pool_pages(PoolSizing(), runner, 0)}
    eng.shutdown()
    return out


@pytest.fixture(scope="module")
def whole_dp2_tp4() -> dict:
    """`answers` of dp=2,tp=4 without DCP: the reference of every split pool's answers here."""
    return answers("dp=2,tp=4", 1)


@needs_model
def test_split_pool_answers_as_the_whole_pool(whole_dp2_tp4):
    whole, split = whole_dp2_tp4, answers("dp=2,tp=4", 4, num_pages=32)
    assert split["long"] > 64 and split["cached"] >= 112  # (chunked: 32 rows a rank a step; the hit happened)
    assert split["tokens"] == whole["tokens"]
    assert split["shard_shape"][-2] == 4  # each device holds 4 of every page's 16 tokens
    assert split["bytes_per_device"] * 4 == whole["bytes_per_device"]  # same pages, a quarter of the memory
    assert split["sized_pages"] == 4 * whole["sized_pages"]  # so the same memory holds 4x the tokens


@needs_model
@pytest.mark.slow
@pytest.mark.parametrize("dcp", [8, 2])
def test_tp8_split_pool_answers_as_the_whole_pool(dcp):
    """tp=8 (one group of 8): dcp 8 (subgroup = the group) and 2 (4 subgroups of 2, collectives over the group)
    answer as dcp=1."""
    whole, split = answers("dp=1,tp=8", 1), answers("dp=1,tp=8", dcp)
    assert split["tokens"] == whole["tokens"] and split["cached"] >= 112
    assert split["bytes_per_device"] * dcp == whole["bytes_per_device"]


def args_of(*flags):
    return build_parser().parse_args(list(flags))


@pytest.mark.parametrize("flags,words", [
    (("--mesh", "dp=8", "--dcp-size", "2"), "tp=1"),
    (("--mesh", "dp=2,tp=4", "--dcp-size", "3"), "must divide"),
    (("--mesh", "dp=2,tp=4", "--dcp-size", "4", "--page-size", "6"), "multiple of --dcp-size"),
    (("--mesh", "dp=2,tp=4", "--dcp-size", "0"), "not a device count"),
])
def test_bad_dcp_flags_refused_in_one_sentence(flags, words):
    with pytest.raises(UserError, match=words) as e:
        serve_config(args_of(*flags))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_dcp_with_disaggregation_is_served(mode):
    config = serve_config(args_of("--mesh", "dp=2,tp=4", "--dcp-size", "4", "--disaggregation-mode", mode))
    assert config.engine.disaggregation.mode == mode
    with pytest.raises(UserError, match="not built with --speculative-algorithm yet; drop one of them"):
        serve_config(args_of("--mesh", "dp=2,tp=4", "--dcp-size", "4", "--speculative-algorithm", "EAGLE"))


def test_engine_refuses_before_loading():
    with pytest.raises(ValueError, match="must divide"):
        Engine("default", "dp=2,tp=4", EngineConfig(disable_cuda_graph=True), warmup=False, dcp_size=3)


def handoff_answers(prefill: tuple[str, int], decode: tuple[str, int]) -> dict:
    """`answers`' prompts (on the same decode ranks) through a prefill engine and a decode engine ((mesh, dcp)
    each, over this process's host devices: a mesh takes the first of them, so the two share devices): the
    decode engine's greedy tokens, and the decode side's figures."""
    port = free_port()

    def engine(mesh, dcp, disagg):
        dp = int(mesh.split(",")[0].removeprefix("dp="))
        cfg = EngineConfig(page_size=16, num_pages=32, max_running_requests=8, chunked_prefill_size=64,
                           decode_buckets=[8 // dp], extend_buckets=[64 // dp], disable_cuda_graph=True,
                           disaggregation=disagg)
        return Engine("default", mesh, cfg, warmup=False, dcp_size=dcp)

    pre = engine(*prefill, DisaggConfig("prefill", bootstrap_port=port, model="default", timeout_s=120))
    dec = engine(*decode, DisaggConfig("decode", model="default", timeout_s=120))
    try:
        for e in (pre, dec):
            e.start()
        def ids(text):
            e = dec.tokenizer.encode(text)
            return e if isinstance(e, list) else e.ids

        rng = np.random.default_rng(0)
        letters = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=120))
        long = ids(f"reverse {letters}=")
        prompts = [long, ids("12+34="), ids(f"reverse {letters[:30]}="), long[:-1] + ids("x=")]
        sp = SamplingParams(max_new_tokens=8, temperature=0)
        reqs = []
        for i, (p, rank) in enumerate(zip(prompts, [0, 1, 0, 0], strict=True)):  # (rooms 2 and 5: prefill rank 1)
            room = [4, 5, 2, 7][i]
            reqs.append(dec.submit(dec.make_request(p, sp, rank=rank, bootstrap=Bootstrap("127.0.0.1", port, room))))
            pre.submit(pre.make_request(p, sp, bootstrap=Bootstrap("127.0.0.1", port, room)))
        deadline = time.monotonic() + 600
        while not all(r.finished for r in reqs):
            assert time.monotonic() < deadline, "the hand-off did not finish"
            time.sleep(0.05)
        return {"tokens": [r.output_ids for r in reqs], "errors": [r.error for r in reqs],
                "kinds": {r.kind for r in dec.stats.records}, "bytes": dec.disagg.transferred_bytes}
    finally:
        pre.shutdown()
        dec.shutdown()


@needs_model
def test_a_hand_off_into_a_split_pool_answers_as_one_server(whole_dp2_tp4):
    """A dcp=1 prefill engine (dp=2) hands its KV to a decode engine of dp=2,tp=4 with --dcp-size 4: each token's
    latent lands on its owner device of each rank's group, and the decode engine answers dcp=1's greedy tokens
    without reading a prompt."""
    got = handoff_answers(("dp=2", 1), ("dp=2,tp=4", 4))
    assert got["errors"] == [None] * 4 and got["kinds"] == {"decode"} and got["bytes"] > 0
    assert got["tokens"] == whole_dp2_tp4["tokens"]


@needs_model
def test_a_split_prefill_pool_hands_off_to_an_unsplit_one(whole_dp2_tp4):
    """The other way: a prefill engine of dp=2,tp=4 with --dcp-size 4 reads its prompts into a split pool and
    hands them to a dp=2 decode engine (the parts gathered from the group's devices and interleaved)."""
    got = handoff_answers(("dp=2,tp=4", 4), ("dp=2", 1))
    assert got["errors"] == [None] * 4 and got["kinds"] == {"decode"}
    assert got["tokens"] == whole_dp2_tp4["tokens"]


def retraction_answers(dcp: int) -> tuple[list, int]:
    """Eight prompts whose answers outgrow a rank's pool of 40 tokens (pages of 4: one slot a device at dcp 4), so
    requests are retracted and read again."""
    cfg = EngineConfig(page_size=4, num_pages=10, max_running_requests=8, chunked_prefill_size=16,
                       decode_buckets=[1, 2, 4], disable_cuda_graph=True)
    eng = Engine("default", "dp=2,tp=4", cfg, warmup=False, dcp_size=dcp)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(10, 500, size=6 + i % 3)] for i in range(8)]
    reqs = eng.generate(prompts, SamplingParams(max_new_tokens=14, temperature=0))
    retracted = sum(s.retracted_total for s in eng.schedulers)
    eng.shutdown()
    return [r.output_ids for r in reqs], retracted


@needs_model
@pytest.mark.slow
def test_retraction_in_a_split_pool():
    """Retraction frees a request's pages and reads it again: in a split pool the answers are dcp=1's."""
    (whole, _), (split, retracted) = retraction_answers(1), retraction_answers(4)
    assert retracted > 0 and split == whole
