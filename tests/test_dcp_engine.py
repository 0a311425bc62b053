"""`--dcp-size` in the engine (issue 48 point 3, docs/dcp.md): under dp=2,tp=4 the pool split over the group's 4
devices answers the same greedy tokens as the unsplit pool (dcp=1), for a prompt read in chunks, a prefix-cache hit
and short prompts on both ranks; at the same memory per device the split pool holds 4 times the tokens. The tp=8
variants (dcp 8 and 2) are slow. Bad sizes are refused in one sentence before anything loads."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.options import DisaggConfig
from jaxdp.model.loader import default_model_path
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


@needs_model
def test_split_pool_answers_as_the_whole_pool():
    whole, split = answers("dp=2,tp=4", 1), answers("dp=2,tp=4", 4, num_pages=32)
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


def test_engine_refuses_before_loading():
    with pytest.raises(ValueError, match="must divide"):
        Engine("default", "dp=2,tp=4", EngineConfig(disable_cuda_graph=True), warmup=False, dcp_size=3)


@needs_model
def test_engine_refuses_a_hand_off_into_a_split_pool():
    cfg = EngineConfig(num_pages=8, disaggregation=DisaggConfig("decode"), disable_cuda_graph=True)
    with pytest.raises(ValueError, match="not built with --dcp-size 4") as e:
        Engine("default", "dp=2,tp=4", cfg, warmup=False, dcp_size=4)
    assert "\n" not in str(e.value)


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
