"""Layouts agree bit for bit under `--enable-deterministic-inference` (issue 48, docs/determinism.md "Across
layouts"): dp=8, tp=8, dp=8 with EP and dp=2,tp=4 answer the probe with the same token ids AND the same logprobs, bit
for bit, because every product whose contraction is split over devices in some layout (o_proj over heads, the
experts' and MLPs' down projections) is computed as partial products over a fixed number of blocks and added by one
fixed tree (`jaxdp.ops.rows.block_sum`) instead of an all-reduce over however many devices hold the pieces. The
default suite compares every logit of a prompt step and 4 decode steps through each layout's compiled steps; the
slow test, the probe's ids and logprobs through an Engine in two companies. Without the flag two layouts give other
logits (so the first can fail). The pieces: the native product's blocks (each the bits of the block alone), its
column tail (the bits of the vector columns), the tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp import native
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.setup import build_runners
from jaxdp.layout import ensure_host_devices, parse_mesh_spec
from jaxdp.model.loader import default_model_path
from jaxdp.one_batch import run_prompts
from jaxdp.ops.rows import block_sum, fixed_blocks

HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
needs_model = pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model (with its tokenizer) is absent")
needs_native = pytest.mark.skipif(not native.available(), reason="jaxdp's native CPU kernels are not built here")
LAYOUTS = ("dp=8", "tp=8", "dp=8,moe=ep", "dp=2,tp=4")


def step_logits(mesh: str, deterministic: bool) -> tuple[np.ndarray, list]:
    """Every logit of two prompts on rank 0 (a prompt step of both, then 4 greedy decode steps) and the greedy
    tokens, through the layout's compiled steps (`jaxdp.one_batch.run_prompts`)."""
    layout = parse_mesh_spec(mesh)
    ensure_host_devices(layout.world)
    runner = build_runners("default", layout, [layout.make_mesh(jax.devices()[: layout.world])], num_pages=16,
                           page_size=16, deterministic=deterministic)[0]
    rng = np.random.default_rng(0)
    out = run_prompts(runner, [list(rng.integers(3, 500, size=n)) for n in (13, 7)], [0, 0], 4)
    logits = np.concatenate([np.concatenate(out["prompt"]), np.concatenate(out["decode"])])
    return logits, [list(t) for t in out["tokens"]]


def answers(mesh: str, deterministic: bool) -> dict[str, tuple]:
    """The probe's (ids, logprobs as float.hex) through an Engine alone on rank 0 and among 3 others."""
    cfg = EngineConfig(page_size=16, num_pages=32, max_running_requests=8, chunked_prefill_size=256,
                       disable_cuda_graph=True)
    eng = Engine("default", mesh, cfg, warmup=False, deterministic=deterministic)
    try:
        enc = (lambda t: e if isinstance(e := eng.tokenizer.encode(t), list) else e.ids)
        probe, others = enc("reverse qwertyuiopasdfghjklzxc="), [enc(t) for t in ("12+34=", "reverse abc=", "7*8=")]
        sp = SamplingParams(max_new_tokens=10, temperature=0, return_logprob=True)
        out = {}
        for name, company in (("alone", []), ("among 3", others)):
            r = eng.generate(company + [probe], sp, ranks=[None] * len(company) + [0])[-1]
            out[name] = (tuple(r.output_ids), tuple(float(v).hex() for v in r.output_logprobs))
            eng.flush_cache()
        return out
    finally:
        eng.shutdown()


@needs_model
@needs_native
def test_the_four_layouts_give_the_same_logits_bit_for_bit_with_the_flag():
    first, tokens = step_logits(LAYOUTS[0], True)
    for mesh in LAYOUTS[1:]:
        logits, toks = step_logits(mesh, True)
        assert toks == tokens, f"{mesh}: greedy tokens differ from dp=8's"
        gap = float(np.abs(logits - first).max())
        assert np.array_equal(logits.view(np.uint32), first.view(np.uint32)), f"{mesh}: logits differ ({gap:.3g})"


@needs_model
def test_without_the_flag_layouts_differ_on_this_machine():
    """What the fixed tree fixes, shown: without the flag tp=8 (o_proj's partials all-reduced over 8 devices, the
    MoE's returned by a reduce-scatter) gives other logits than dp=8 (the same greedy tokens: wide margins)."""
    (a, ta), (b, tb) = step_logits("dp=8", False), step_logits("tp=8", False)
    assert ta == tb and not np.array_equal(a, b)


@pytest.mark.slow
@needs_model
@needs_native
def test_the_four_layouts_answer_the_same_ids_and_logprobs_through_an_engine():
    got = {mesh: answers(mesh, True) for mesh in LAYOUTS}
    first = got[LAYOUTS[0]]
    assert first["alone"] == first["among 3"]
    for mesh in LAYOUTS[1:]:
        for company in first:
            a, b = first[company], got[mesh][company]
            assert a[0] == b[0], f"{mesh} {company}: token ids differ from dp=8's"
            gap = max(abs(float.fromhex(x) - float.fromhex(y)) for x, y in zip(a[1], b[1], strict=True))
            assert a[1] == b[1], f"{mesh} {company}: logprobs differ from dp=8's (largest gap {gap:.3g})"


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_blocks_are_the_bits_of_each_block_alone(dtype):
    """`grouped_matmul(kblocks=8)`'s block j equals the product of block j's columns of x by its rows of w (what a
    device holding only that block computes), bit for bit; the blocks add up to the product; a column in the scalar
    tail (a slice 8 wide) has the bits of the same column in a vector tile (the slice of a 72-wide product)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((13, 32)), dtype)
    w = jnp.asarray(rng.standard_normal((2, 3, 32, 72)), dtype)
    sizes = jnp.asarray([5, 0, 6], jnp.int32)
    run = jax.jit(native.grouped_matmul, static_argnames="kblocks")
    full, blocks = np.asarray(run(x, w, 1, sizes)), np.asarray(run(x, w, 1, sizes, kblocks=8))
    assert blocks.shape == (8, 13, 72) and not blocks[:, 11:].any()  # rows past the groups: zeros
    np.testing.assert_allclose(blocks.sum(0), full, rtol=1e-5, atol=1e-5)
    for j in range(8):
        alone = np.asarray(run(x[:, 4 * j:4 * j + 4], w[:, :, 4 * j:4 * j + 4], 1, sizes))
        assert np.array_equal(alone, blocks[j]), f"block {j}"
    assert np.array_equal(np.asarray(run(x, w[..., 8:16], 1, sizes)), full[:, 8:16])
    with pytest.raises(ValueError, match="do not divide"):
        native.grouped_matmul(x, w, 1, sizes, kblocks=5)


def test_block_sum_is_the_sum_by_a_fixed_tree():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 3, 5)), jnp.float32)
    np.testing.assert_allclose(np.asarray(block_sum(x)), np.asarray(x).sum(0), rtol=1e-6, atol=1e-6)
    tree = ((x[0] + x[4]) + (x[2] + 0)) + ((x[1] + x[5]) + (x[3] + 0))  # pairs i and i + half, padded to 8
    assert np.array_equal(np.asarray(block_sum(x)), np.asarray(tree))
    assert [fixed_blocks(w, d) for w, d in ((8, 1), (8, 8), (4, 2), (512, 8), (8, 16))] == [8, 8, 4, 8, 16]
