"""Absorbed-MLA paged decode kernel against its jnp reference, and a smoke run of the kernel bench.

Kernels run with interpret=True on the CPU. JAXDP_PALLAS_INTERPRET=0 runs them compiled (GPU only; the
kernel tests skip on a CPU backend), =1 forces the interpreter.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.planner.xla_target import plugin_installed
from kernels_pallas.mla_decode import combine_splits, mla_decode, mla_decode_reference

_ENV = os.environ.get("JAXDP_PALLAS_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV != "0"
needs_kernel_backend = pytest.mark.skipif(
    INTERPRET is False and jax.default_backend() == "cpu",
    reason="JAXDP_PALLAS_INTERPRET=0 needs a GPU backend",
)

needs_plugin = pytest.mark.skipif(
    not plugin_installed(), reason="XLA:GPU's CUDA plugin is not on this process's path: CI runs these through "
    "tests/test_xla_gpu.py (the xla-gpu extra installed apart); here: pip install -e '.[xla-gpu]'")

C, R = 32, 16  # latent and rope widths: small powers of two (512 and 64 in real models)


def make_case(batch, heads, page_size, max_pages, lengths, dtype, seed=0):
    """Random queries and cache; each row owns distinct shuffled pages; unused table slots hold -1."""
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + 3
    q_latent = jnp.asarray(rng.standard_normal((batch, heads, C)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((batch, heads, R)), dtype)
    kv_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, C + R)), dtype)
    table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages)
    for row, length in enumerate(lengths):
        table[row, math.ceil(length / page_size):] = -1
    return q_latent, q_rope, kv_cache, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


def test_reference_matches_dense_softmax_for_one_row():
    q_latent, q_rope, kv, table, lengths = make_case(1, 2, 4, 3, [10], jnp.float32)
    out = mla_decode_reference(q_latent, q_rope, kv, table, lengths, softmax_scale=0.3, kv_lora_rank=C)
    rows = np.concatenate([np.asarray(kv)[p] for p in np.asarray(table[0, :3])])[:10]  # [10, C + R]
    scores = 0.3 * (np.asarray(q_latent[0]) @ rows[:, :C].T + np.asarray(q_rope[0]) @ rows[:, C:].T)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(out[0], probs @ rows[:, :C], rtol=1e-5, atol=1e-5)


@needs_kernel_backend
@pytest.mark.parametrize(
    "page_size, max_pages, lengths, num_splits",
    [
        (4, 12, [45, 0, 1], None),  # several pages per token block, ragged lengths with 0 and 1
        (16, 4, [64, 1, 0], 1),  # a full table, one split
        (64, 3, [130, 1, 0], 2),  # a block per page, a split boundary inside the context
    ],
)
def test_mla_decode_matches_reference_f32(page_size, max_pages, lengths, num_splits):
    q_latent, q_rope, kv, table, lens = make_case(3, 4, page_size, max_pages, lengths, jnp.float32)
    out = mla_decode(q_latent, q_rope, kv, table, lens, softmax_scale=0.2, kv_lora_rank=C,
                     num_splits=num_splits, interpret=INTERPRET)
    expected = mla_decode_reference(q_latent, q_rope, kv, table, lens, softmax_scale=0.2, kv_lora_rank=C)
    assert out.shape == (3, 4, C) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(lens) == 0], 0.0)
    one = lengths.index(1)  # attending to a single token returns that token's latent for every head
    first_latent = np.asarray(kv)[int(table[one, 0]), 0, :C]
    np.testing.assert_allclose(out[one], np.broadcast_to(first_latent, (4, C)), rtol=1e-5, atol=1e-5)


@needs_kernel_backend
def test_mla_decode_bf16_invalid_rows_and_odd_heads():
    lengths = [33, 1, 0, 50, 17]
    q_latent, q_rope, kv, table, lens = make_case(5, 20, 16, 4, lengths, jnp.bfloat16, seed=1)
    valid = jnp.int32(3)  # traced, as the model passes it: rows 3 and 4 are padding
    out = mla_decode(q_latent, q_rope, kv, table, lens, softmax_scale=0.15, kv_lora_rank=C,
                     num_valid_rows=valid, num_splits=3, interpret=INTERPRET)
    expected = mla_decode_reference(q_latent, q_rope, kv, table, lens, softmax_scale=0.15, kv_lora_rank=C,
                                    num_valid_rows=3)
    assert out.shape == (5, 20, C) and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=3e-2,
                               rtol=3e-2)
    assert np.all(np.asarray(out, np.float32)[2:] == 0.0)
    assert np.abs(np.asarray(out, np.float32)[0]).max() > 0.1


def test_combine_splits_weights_by_log_sum_exp():
    out_BSHC = jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]]])  # [1, 3 splits, 1 head, 2]
    lse_BSH = jnp.array([[[0.0], [jnp.log(3.0)], [-jnp.inf]]])  # weights 1 : 3 : 0
    np.testing.assert_allclose(combine_splits(out_BSHC, lse_BSH), [[[0.25, 0.75]]], rtol=1e-6)
    empty = combine_splits(out_BSHC, jnp.full((1, 3, 1), -jnp.inf))
    np.testing.assert_array_equal(empty, 0.0)


def test_mla_decode_rejects_bad_shapes():
    q_latent, q_rope, kv, table, lens = make_case(1, 2, 4, 2, [3], jnp.float32)
    with pytest.raises(ValueError, match="disagree"):
        mla_decode(q_latent, q_rope, kv, table, lens, softmax_scale=1.0, kv_lora_rank=C // 2)
    with pytest.raises(ValueError, match="power of two"):
        mla_decode(q_latent[..., :24], q_rope, kv[..., 8:], table, lens, softmax_scale=1.0, kv_lora_rank=24)


def test_mla_decode_lowers_to_triton_at_real_shapes():
    """Lowers (not compiles) for CUDA on any host: catches Triton-lowering errors without a GPU."""
    from jax import export

    spec = jax.ShapeDtypeStruct
    b, h, c, r, page_size, pages = 5, 128, 512, 64, 64, 40  # DeepSeek-V3 heads, an odd batch
    fn = jax.jit(lambda *a: mla_decode(*a[:5], num_valid_rows=a[5], softmax_scale=0.1, kv_lora_rank=c,
                                       interpret=False))
    exported = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        spec((b, h, c), jnp.bfloat16), spec((b, h, r), jnp.bfloat16),
        spec((b * pages, page_size, c + r), jnp.bfloat16), spec((b, pages), jnp.int32),
        spec((b,), jnp.int32), spec((), jnp.int32))
    assert exported.mlir_module().count("xla.gpu.triton") == 1


@needs_plugin
@pytest.mark.parametrize("sparse", [False, True])
def test_decode_kernels_compile_for_a_simulated_h200(sparse):
    """Compiled (not only lowered) by XLA:GPU for an H200 without a GPU, interpret left to the kernel: the
    platform compiled for picks Triton, and the launch grid is (head blocks, context splits, rows)."""
    from jaxdp.planner.hlo_checks import parse, triton_calls
    from jaxdp.planner.xla_target import compile_for_gpu
    from kernels_pallas.sparse_mla_decode import sparse_mla_decode

    spec = jax.ShapeDtypeStruct
    b, h, c, r, page_size, pages, k = 5, 128, 512, 64, 64, 40, 2048  # DeepSeek-V3 heads, GLM-5's index_topk
    q = (spec((b, h, c), jnp.bfloat16), spec((b, h, r), jnp.bfloat16))
    if sparse:
        fn = lambda *a: sparse_mla_decode(*a, softmax_scale=0.1, kv_lora_rank=c)
        args = (*q, spec((pages, page_size, c + r), jnp.bfloat16), spec((b, k), jnp.int32), spec((b,), jnp.int32))
        grid = (8, 7, b)  # as below, the 2048 selected tokens being 64 blocks of 32 (more than 7)
    else:
        fn = lambda *a: mla_decode(*a, softmax_scale=0.1, kv_lora_rank=c)
        args = (*q, spec((b * pages, page_size, c + r), jnp.bfloat16), spec((b, pages), jnp.int32),
                spec((b,), jnp.int32))
        grid = (8, 7, b)  # 128 heads / 16; splits = cdiv(2 x 132 SMs, 5 rows x 8 head blocks) = 7 (of 40 pages)
    compiled = compile_for_gpu(fn, *args)
    calls = triton_calls(parse(compiled.as_text()))
    name = "sparse_mla_decode_split" if sparse else "mla_decode_split"
    assert [(k["name"], k["grid"]) for k in calls] == [(name, grid)], calls
    assert compiled.memory_analysis().output_size_in_bytes == b * h * c * 2


@needs_kernel_backend
def test_bench_tiny_preset_runs_and_writes_json(tmp_path, capsys):
    from kernels_pallas import bench

    out = tmp_path / "bench.json"
    bench.main(["--preset", "tiny", "--json", str(out)])
    report = json.loads(out.read_text())
    kinds = {(r["kernel"], r["path"]) for r in report["results"]}
    assert kinds == {(k, p) for k in ("mla_decode", "nvfp4_gate_up", "nvfp4_down") for p in ("pallas", "xla")}
    assert all(r["error"] is None and r["time_us"] > 0 and r["gbs"] > 0 for r in report["results"])
    assert all(r["max_abs_diff"] < 0.1 for r in report["results"] if r["path"] == "pallas")
    assert "GB/s" in capsys.readouterr().out


# ---- the sparse (DSA) decode kernel --------------------------------------------------------------


def make_sparse_case(batch, heads, page_size, num_pages, k, nums, dtype, seed=0):
    """Random queries and cache; row b selects k distinct cache rows (its first nums[b] valid)."""
    rng = np.random.default_rng(seed)
    q_latent = jnp.asarray(rng.standard_normal((batch, heads, C)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((batch, heads, R)), dtype)
    kv_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, C + R)), dtype)
    slots = np.stack([rng.permutation(num_pages * page_size)[:k] for _ in range(batch)])
    return q_latent, q_rope, kv_cache, jnp.asarray(slots, jnp.int32), jnp.asarray(nums, jnp.int32)


@needs_kernel_backend
@pytest.mark.parametrize("k, nums, block_t, num_splits", [
    (40, [40, 0, 1, 23], 16, None),  # a selection that is not a whole number of blocks; empty and 1-token rows
    (64, [64, 64, 5, 33], 32, 1),  # one split
    (48, [48, 17, 0, 47], 16, 3),  # a split boundary inside the selection
])
def test_sparse_mla_decode_matches_the_xla_path_f32(k, nums, block_t, num_splits):
    from jaxdp.model.mla import sparse_mla_decode_xla
    from kernels_pallas.sparse_mla_decode import sparse_mla_decode

    q_latent, q_rope, kv, slots, num = make_sparse_case(4, 4, 8, 16, k, nums, jnp.float32)
    with jax.default_matmul_precision("highest"):
        out = sparse_mla_decode(q_latent, q_rope, kv, slots, num, softmax_scale=0.2, kv_lora_rank=C,
                                block_t=block_t, num_splits=num_splits, interpret=INTERPRET)
        expected = sparse_mla_decode_xla(q_latent, q_rope, kv, slots, num, softmax_scale=0.2, kv_lora_rank=C)
    assert out.shape == (4, 4, C) and out.dtype == jnp.float32
    live = np.asarray(num) > 0  # the XLA path gives a uniform average where nothing is selected: unused
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(expected)[live], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out)[~live], 0.0)
    one = nums.index(1) if 1 in nums else None
    if one is not None:  # a single selected token: its latent, for every head
        flat = np.asarray(kv).reshape(-1, C + R)
        np.testing.assert_allclose(out[one], np.broadcast_to(flat[int(slots[one, 0]), :C], (4, C)), atol=1e-5)


@needs_kernel_backend
def test_sparse_mla_decode_over_every_token_is_the_dense_decode():
    """Independent of the XLA sparse path: selecting a row's whole context gives mla_decode's reference."""
    from kernels_pallas.sparse_mla_decode import sparse_mla_decode

    page_size, max_pages, lengths = 4, 6, [21, 9, 24]
    q_latent, q_rope, kv, table, lens = make_case(3, 20, page_size, max_pages, lengths, jnp.bfloat16, seed=2)
    pos = np.arange(max_pages * page_size)
    slots = np.asarray(table)[:, pos // page_size] * page_size + pos % page_size  # -1 pages: masked anyway
    out = sparse_mla_decode(q_latent, q_rope, kv, jnp.asarray(slots, jnp.int32), lens, softmax_scale=0.15,
                            kv_lora_rank=C, block_t=16, interpret=INTERPRET)
    expected = mla_decode_reference(q_latent, q_rope, kv, table, lens, softmax_scale=0.15, kv_lora_rank=C)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=3e-2, rtol=3e-2)


def test_sparse_mla_decode_lowers_to_triton_at_real_shapes():
    from jax import export

    from kernels_pallas.sparse_mla_decode import sparse_mla_decode

    spec = jax.ShapeDtypeStruct
    b, h, c, r, page_size, pages, k = 5, 64, 512, 64, 64, 80, 2048  # GLM-5's heads and index_topk
    fn = jax.jit(lambda *a: sparse_mla_decode(*a, softmax_scale=0.1, kv_lora_rank=c, interpret=False))
    exported = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        spec((b, h, c), jnp.bfloat16), spec((b, h, r), jnp.bfloat16),
        spec((pages, page_size, c + r), jnp.bfloat16), spec((b, k), jnp.int32), spec((b,), jnp.int32))
    assert exported.mlir_module().count("xla.gpu.triton") == 1
