"""NVFP4 format (ModelOpt layout) and the grouped expert GEMM against plain references.

Kernels run with interpret=True on the CPU. JAXDP_PALLAS_INTERPRET=0 runs them compiled (GPU only; the
kernel tests skip on a CPU backend), =1 forces the interpreter.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.planner.xla_target import plugin_installed
from kernels_pallas.nvfp4 import (
    E2M1_VALUES,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_decode_arith,
    e2m1_encode,
    pack_e2m1,
    quantize_nvfp4,
    quantize_nvfp4_experts,
    quantize_nvfp4_experts_gate_up,
    quantize_nvfp4_gate_up,
    unpack_codes,
    unpack_e2m1,
)
from kernels_pallas.nvfp4_moe import nvfp4_grouped_matmul, nvfp4_grouped_matmul_reference, tile_schedule

_ENV = os.environ.get("JAXDP_PALLAS_INTERPRET", "")
INTERPRET = None if _ENV == "" else _ENV != "0"
needs_kernel_backend = pytest.mark.skipif(
    INTERPRET is False and jax.default_backend() == "cpu",
    reason="JAXDP_PALLAS_INTERPRET=0 needs a GPU backend",
)


def test_decode_lut_and_arith_agree_on_all_codes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(e2m1_decode(codes), np.asarray(E2M1_VALUES, np.float32))
    np.testing.assert_array_equal(e2m1_decode_arith(codes), e2m1_decode(codes))


def test_pack_puts_even_column_in_low_nibble():
    packed = pack_e2m1(jnp.array([[1.0, -6.0, 0.5, 3.0]]))
    # 1.0 is code 2, -6 is code 8|7 = 15, 0.5 is code 1, 3.0 is code 5
    np.testing.assert_array_equal(packed, np.array([[0xF2, 0x51]], np.uint8))
    assert packed.dtype == jnp.uint8


def test_pack_unpack_exact_on_representable_values():
    rng = np.random.default_rng(0)
    values = rng.choice(np.asarray(E2M1_VALUES, np.float32), size=(6, 32))
    packed = pack_e2m1(jnp.asarray(values))
    assert packed.shape == (6, 16)
    np.testing.assert_array_equal(unpack_e2m1(packed), values)
    all_bytes = np.arange(256, dtype=np.uint8)[None, :]
    np.testing.assert_array_equal(unpack_codes(jnp.asarray(all_bytes))[0, 0::2], all_bytes[0] & 0xF)
    again = np.asarray(pack_e2m1(unpack_e2m1(jnp.asarray(all_bytes))))
    negative_zero = ((all_bytes & 0xF) == 8) | ((all_bytes >> 4) == 8)  # -0 re-encodes as +0
    np.testing.assert_array_equal(again[~negative_zero], all_bytes[~negative_zero])
    np.testing.assert_array_equal(unpack_e2m1(jnp.asarray(again)), unpack_e2m1(jnp.asarray(all_bytes)))


def test_encode_rounds_to_nearest_ties_to_even_and_saturates():
    x = jnp.array([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.74, -100.0])
    expected = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -6.0]
    np.testing.assert_array_equal(e2m1_decode(e2m1_encode(x)), expected)


def _effective_scale(block_scale_NB, scale_2):
    return np.repeat(np.asarray(block_scale_NB.astype(jnp.float32)), 16, axis=-1) * float(scale_2)


def _worst(w, w_hat, bound) -> str:
    """The element furthest past its bound, for the failure message."""
    w, w_hat = np.asarray(w, np.float32), np.asarray(w_hat, np.float32)
    i = np.unravel_index(np.argmax(np.abs(w - w_hat) / bound), w.shape)
    return f"at {i}: w {w[i]!r}, dequantized {w_hat[i]!r}, bound {bound[i]!r} ({jax.default_backend()})"


def test_quantize_dequantize_within_error_bound():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((16, 128)) * np.exp(rng.standard_normal((16, 1))), jnp.float32)
    w = w.at[3, 16:32].set(0.0)  # an all-zero block
    tiny_block = 1e-5 * float(jnp.max(jnp.abs(w))) * jnp.linspace(-1.0, 1.0, 16)
    w = w.at[5, 32:48].set(tiny_block)  # 1e-5 of the tensor amax: a subnormal E4M3 block scale
    packed, block_scale, scale_2 = quantize_nvfp4(w)
    assert packed.shape == (16, 64) and packed.dtype == jnp.uint8
    assert block_scale.shape == (16, 8) and block_scale.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(scale_2, np.max(np.abs(w)) / (6 * 448), rtol=1e-6)
    assert float(jnp.max(block_scale.astype(jnp.float32))) <= 448.0
    w_hat = np.asarray(dequantize_nvfp4(packed, block_scale, scale_2, jnp.float32))
    err = np.abs(np.asarray(w) - w_hat)
    s = _effective_scale(block_scale, scale_2)
    normal = np.repeat(np.asarray(block_scale.astype(jnp.float32)) >= 2.0**-6, 16, axis=-1)
    assert normal.sum() == w.size - 16
    # half the widest E2M1 gap (4 -> 6), in block units
    assert np.all(err[normal] <= s[normal] * (1 + 1e-6)), _worst(np.where(normal, w, 0), np.where(normal, w_hat, 0), s)
    small = normal & (np.abs(np.asarray(w)) <= 2 * s)
    assert np.all(err[small] <= s[small] / 4 * (1 + 1e-6))
    assert 0 < float(block_scale[5, 2].astype(jnp.float32)) < 2.0**-6
    assert np.all(err[5, 32:48] <= np.abs(np.asarray(tiny_block)).max())  # the subnormal block's bound
    assert np.all(w_hat[3, 16:32] == 0.0) and np.isfinite(w_hat).all()
    rel = np.linalg.norm(err) / np.linalg.norm(np.asarray(w))
    assert rel < 0.12, rel  # typical NVFP4 error on Gaussian weights is ~8-10%
    assert dequantize_nvfp4(packed, block_scale, scale_2, jnp.bfloat16).dtype == jnp.bfloat16


def test_quantize_rejects_k_not_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(jnp.ones((4, 24)))


def test_gate_up_share_one_global_scale():
    w_gate = jax.random.normal(jax.random.key(2), (8, 32))
    w_up = 3.0 * jax.random.normal(jax.random.key(3), (8, 32))
    (pg, sg, s2g), (pu, su, s2u) = quantize_nvfp4_gate_up(w_gate, w_up)
    assert float(s2g) == float(s2u)
    np.testing.assert_allclose(s2g, max(np.abs(w_gate).max(), np.abs(w_up).max()) / 2688, rtol=1e-6)
    for w, p, s in ((w_gate, pg, sg), (w_up, pu, su)):
        w_hat = np.asarray(dequantize_nvfp4(p, s, s2g))
        bound = _effective_scale(s, s2g)
        assert np.all(np.abs(np.asarray(w) - w_hat) <= bound * (1 + 1e-6)), _worst(w, w_hat, bound)
    fused_p, fused_s, fused_2 = quantize_nvfp4_experts_gate_up(jnp.stack([w_gate] * 2), jnp.stack([w_up] * 2))
    assert fused_p.shape == (2, 16, 16) and fused_s.shape == (2, 16, 2) and fused_2.shape == (2,)
    np.testing.assert_array_equal(fused_p[1], jnp.concatenate([pg, pu]))


# ---- grouped GEMM -------------------------------------------------------------------------------------

E, N, K = 4, 32, 64


@pytest.fixture(scope="module")
def experts():
    w_ENK = jax.random.normal(jax.random.key(4), (E, N, K)) * 0.1
    return quantize_nvfp4_experts(w_ENK)


def _loop_reference(x_TK, packed, scales, scale_2, sizes, valid_rows):
    """Row by row in numpy: the definition of the grouped GEMM."""
    w_ENK = np.asarray(dequantize_nvfp4(packed, scales, scale_2, jnp.float32))
    x = np.asarray(x_TK, np.float32)
    y = np.zeros((x.shape[0], w_ENK.shape[1]), np.float32)
    row = 0
    for e, size in enumerate(sizes):
        for t in range(row, min(row + size, valid_rows)):
            y[t] = w_ENK[e] @ x[t]
        row += size
    return y


def test_tile_schedule_never_straddles_experts():
    expert, start, end, count = tile_schedule(jnp.array([5, 0, 20, 3], jnp.int32), 32, 8)
    n = int(count[0])
    assert n == 1 + 0 + 3 + 1
    assert list(np.asarray(expert[:n])) == [0, 2, 2, 2, 3]
    assert list(np.asarray(start[:n])) == [0, 5, 13, 21, 25]
    assert list(np.asarray(end[:n])) == [5, 13, 21, 25, 28]


def test_reference_matches_row_loop(experts):
    sizes = [3, 0, 4, 2]
    x = jax.random.normal(jax.random.key(5), (11, K))
    y = nvfp4_grouped_matmul_reference(x, *experts, jnp.array(sizes, jnp.int32))
    np.testing.assert_allclose(y, _loop_reference(x, *experts, sizes, 11), rtol=1e-5, atol=1e-5)
    y = nvfp4_grouped_matmul_reference(x, *experts, jnp.array(sizes, jnp.int32), num_valid_rows=5)
    np.testing.assert_allclose(y, _loop_reference(x, *experts, sizes, 5), rtol=1e-5, atol=1e-5)


@needs_kernel_backend
@pytest.mark.parametrize(
    "sizes, num_rows, valid, dtype",
    [
        ([5, 0, 9, 3], 21, None, jnp.float32),  # an empty group in the middle, 4 padding rows
        ([0, 7, 0, 0], 21, None, jnp.float32),  # empty groups at both ends, 14 padding rows
        ([0, 0, 0, 0], 21, None, jnp.float32),  # nothing routed: all zeros
        ([2, 1, 17, 0], 21, 12, jnp.bfloat16),  # num_valid_rows cuts into a group; rows > 16 per expert
        ([1, 2, 1, 1], 5, None, jnp.float32),  # a batch that is not a power of two, no padding
    ],
)
def test_grouped_matmul_matches_reference(experts, sizes, num_rows, valid, dtype):
    x = jax.random.normal(jax.random.key(6), (num_rows, K)).astype(dtype)
    group_sizes = jnp.array(sizes, jnp.int32)
    valid_arg = None if valid is None else jnp.int32(valid)  # traced, as the model passes it
    y = nvfp4_grouped_matmul(x, *experts, group_sizes, num_valid_rows=valid_arg, block_n=16, block_k=32,
                             interpret=INTERPRET)
    assert y.shape == (num_rows, N) and y.dtype == dtype
    expected = _loop_reference(x, *experts, sizes, num_rows if valid is None else valid)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=tol, atol=tol)
    routed = min(sum(sizes), num_rows if valid is None else valid)
    assert np.all(np.asarray(y, np.float32)[routed:] == 0.0)


@needs_kernel_backend
def test_grouped_matmul_reads_one_layer_of_a_stack(experts):
    """With a layer index the weights are a stack [L, E, ...] (what the layer scan hands the kernel whole): the
    result is that of the layer alone."""
    other = quantize_nvfp4_experts(jax.random.normal(jax.random.key(9), (E, N, K)) * 0.3)
    stack = [jnp.stack([a, b]) for a, b in zip(other, experts, strict=True)]
    x = jax.random.normal(jax.random.key(6), (21, K))
    sizes = jnp.array([2, 1, 17, 0], jnp.int32)
    for layer, weights in ((1, experts), (0, other)):
        y = nvfp4_grouped_matmul(x, *stack, sizes, jnp.int32(layer), block_n=16, block_k=32, interpret=INTERPRET)
        np.testing.assert_allclose(y, _loop_reference(x, *weights, [2, 1, 17, 0], 21), rtol=1e-5, atol=1e-5)


@needs_kernel_backend
def test_grouped_matmul_down_shape_and_default_blocks(experts):
    # down projection [E, H, I]: here N=64 outputs from K=32 inputs; default block sizes clip to the dims
    w = jax.random.normal(jax.random.key(7), (E, 64, 32))
    down = quantize_nvfp4_experts(w)
    x = jax.random.normal(jax.random.key(8), (6, 32))
    sizes = [1, 2, 0, 2]
    y = nvfp4_grouped_matmul(x, *down, jnp.array(sizes, jnp.int32), interpret=INTERPRET)
    np.testing.assert_allclose(y, _loop_reference(x, *down, sizes, 6), rtol=1e-5, atol=1e-5)


def test_grouped_matmul_rejects_mismatched_operands(experts):
    with pytest.raises(ValueError, match="do not match"):
        nvfp4_grouped_matmul(jnp.ones((4, 2 * K)), *experts, jnp.array([4, 0, 0, 0], jnp.int32))
    with pytest.raises(ValueError, match="power of two"):
        nvfp4_grouped_matmul(jnp.ones((4, K)), *experts, jnp.array([4, 0, 0, 0], jnp.int32), block_m=12)


@pytest.mark.skipif(
    not plugin_installed(), reason="XLA:GPU's CUDA plugin is not on this process's path: CI runs these through "
    "tests/test_xla_gpu.py (the xla-gpu extra installed apart); here: pip install -e '.[xla-gpu]'")
def test_grouped_matmul_compiles_for_a_simulated_h200():
    """Compiled (not only lowered) by XLA:GPU for an H200 without a GPU, interpret left to the kernel: the
    platform compiled for picks Triton; grid = (row tiles of 16 + one per expert, N / 64)."""
    from jaxdp.planner.hlo_checks import parse, triton_calls
    from jaxdp.planner.xla_target import compile_for_gpu

    spec = jax.ShapeDtypeStruct
    e, n, k, t = 8, 4096, 6144, 64  # GLM-5 gate/up [2I, H] for a few experts
    compiled = compile_for_gpu(lambda *a: nvfp4_grouped_matmul(*a[:5], num_valid_rows=a[5]),
                               spec((t, k), jnp.bfloat16), spec((e, n, k // 2), jnp.uint8),
                               spec((e, n, k // 16), jnp.float8_e4m3fn), spec((e,), jnp.float32),
                               spec((e,), jnp.int32), spec((), jnp.int32))
    calls = triton_calls(parse(compiled.as_text()))
    assert [(c["name"], c["grid"]) for c in calls] == [("nvfp4_grouped_matmul", (64 // 16 + 8, 4096 // 64, 1))]
    assert compiled.memory_analysis().output_size_in_bytes == t * n * 2


def test_grouped_matmul_lowers_to_triton_at_real_shapes():
    """Lowers (not compiles) for CUDA on any host: catches Triton-lowering errors without a GPU."""
    from jax import export

    spec = jax.ShapeDtypeStruct
    e, n, k, t = 8, 4096, 6144, 64  # GLM-5 gate/up [2I, H] for a few experts
    fn = jax.jit(lambda *a: nvfp4_grouped_matmul(*a[:5], num_valid_rows=a[5], interpret=False))
    exported = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        spec((t, k), jnp.bfloat16), spec((e, n, k // 2), jnp.uint8), spec((e, n, k // 16), jnp.float8_e4m3fn),
        spec((e,), jnp.float32), spec((e,), jnp.int32), spec((), jnp.int32))
    assert exported.mlir_module().count("xla.gpu.triton") == 1
