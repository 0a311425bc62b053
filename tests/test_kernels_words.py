"""One-byte operands read as 16-bit words (kernels_pallas/words.py), the way around Pallas' 32-bit offsets.

On the CPU (interpret mode) every kernel that reads FP8 or NVFP4 bytes gives the same result with its operands
read as words as without. With JAXDP_PALLAS_INTERPRET=0 on a GPU the same tests run compiled by Triton, and two
more build operands of 2 to 4 GiB (where Pallas' offsets overflow) and check a product that reads their far end
(`benchmarks/gpu_session.sh` runs them)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.model import fp8
from kernels_pallas import fp8_gemm
from kernels_pallas.fp8_gemm import block_columns, fp8_grouped_matmul, fp8_matmul
from kernels_pallas.nvfp4 import dequantize_nvfp4, quantize_nvfp4_experts
from kernels_pallas.nvfp4_moe import nvfp4_grouped_matmul
from kernels_pallas.words import as_words, needs_words

_ENV = os.environ.get("JAXDP_PALLAS_INTERPRET", "")
INTERPRET = True if _ENV == "" else _ENV != "0"
pytestmark = pytest.mark.skipif(not INTERPRET and jax.default_backend() == "cpu",
                                reason="JAXDP_PALLAS_INTERPRET=0 needs a GPU backend")
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu" or INTERPRET,
                            reason="2-4 GiB operands through the kernels compiled by Triton: run on an NVIDIA GPU "
                                   "machine by benchmarks/gpu_session.sh (one H200, docs/h200.md)")


def quantized(rng, shape, blocks=None):
    w = rng.standard_normal(shape).astype(np.float32)
    q, s = fp8.quantize(w, blocks or (1,) * (len(shape) - 2) + (128, 128))
    return jnp.asarray(q), jnp.asarray(s)


def test_which_operands_need_words():
    assert not needs_words((2**31,), jnp.uint8)  # offsets up to 2**31 - 1: still positive
    assert needs_words((2**31 + 2,), jnp.uint8) and needs_words((4, 2**30), jnp.float8_e4m3fn)
    assert not needs_words((2**32 + 2,), jnp.uint8)  # over 4 GiB Pallas takes 64-bit offsets
    assert not needs_words((3 * 2**30,), jnp.bfloat16)  # two-byte elements: at most 2**31 of them in 4 GiB
    x = jnp.asarray(np.arange(12, dtype=np.uint8).reshape(2, 6))
    np.testing.assert_array_equal(as_words(x), np.arange(12, dtype=np.uint8).reshape(2, 6).view(np.uint16))
    with pytest.raises(ValueError, match="even last axis"):
        as_words(jnp.zeros((2, 5), jnp.uint8))


def test_fp8_dense_and_grouped_read_as_words_the_same():
    rng = np.random.default_rng(0)
    q, s = quantized(rng, (3, 256, 128))
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    cols = block_columns(128)
    plain = fp8_matmul(x, q, s, cols, jnp.int32(2), interpret=INTERPRET, words=False)
    np.testing.assert_array_equal(fp8_matmul(x, q, s, cols, jnp.int32(2), interpret=INTERPRET, words=True), plain)
    qe, se = quantized(rng, (2, 4, 256, 128))
    group = jnp.asarray([3, 0, 9, 2], jnp.int32)
    xe = jnp.asarray(rng.standard_normal((14, 256)), jnp.bfloat16)
    plain = fp8_grouped_matmul(xe, qe, se, cols, group, jnp.int32(1), interpret=INTERPRET, words=False)
    np.testing.assert_array_equal(
        fp8_grouped_matmul(xe, qe, se, cols, group, jnp.int32(1), interpret=INTERPRET, words=True), plain)


@pytest.mark.parametrize("contract,offset,width", [("A", 128, 128), ("B", 128, 64)])
def test_fp8_head_products_read_as_words_the_same(contract, offset, width):
    rng = np.random.default_rng(1)
    a, h, b = 256, 2, 256
    q, s = quantized(rng, (2, a, h, b), (1, 128, 1, 128))  # scales [L, A/128, H, B/128]
    cols = block_columns(b)
    k = a if contract == "A" else width
    x = jnp.asarray(rng.standard_normal((6, h, k)), jnp.bfloat16)
    kw = dict(offset=offset, width=width, contract=contract, interpret=INTERPRET)
    plain = fp8_gemm.fp8_head_matmul(x, q, s, cols, jnp.int32(1), words=False, **kw)
    np.testing.assert_array_equal(fp8_gemm.fp8_head_matmul(x, q, s, cols, jnp.int32(1), words=True, **kw), plain)


def test_nvfp4_grouped_reads_as_words_the_same():
    experts = quantize_nvfp4_experts(jax.random.normal(jax.random.key(0), (4, 64, 512)) * 0.3)
    stack = [jnp.stack([w, w[::-1]]) for w in experts]
    x = jax.random.normal(jax.random.key(1), (21, 512), jnp.bfloat16)
    sizes = jnp.array([2, 1, 17, 0], jnp.int32)
    plain = nvfp4_grouped_matmul(x, *stack, sizes, jnp.int32(1), block_n=16, interpret=INTERPRET, words=False)
    np.testing.assert_array_equal(
        nvfp4_grouped_matmul(x, *stack, sizes, jnp.int32(1), block_n=16, interpret=INTERPRET, words=True), plain)


def _fp8_bits(key, shape):
    """Random e4m3 codes without NaN (the lowest mantissa bit cleared: never S.1111.111)."""
    return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8) & 0xFE, jnp.float8_e4m3fn)


@on_gpu
def test_a_2gib_fp8_stack_is_read_at_its_far_end():
    """fp8_matmul on the last layer of a 2.3 GB FP8 stack (DeepSeek-V3's w_q_b under dp=8 is this size): the
    offsets pass 2**31 elements."""
    shape = (18, 4096, 32768)  # 2.4e9 one-byte elements
    assert needs_words(shape, jnp.float8_e4m3fn)
    w = jax.jit(_fp8_bits, static_argnums=1)(jax.random.key(0), shape)
    s = jnp.ones((18, 4096 // 128, 32768 // 128), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (8, 4096), jnp.bfloat16)
    got = fp8_matmul(x, w, s, block_columns(32768), jnp.int32(17), interpret=False)
    want = jnp.dot(x.astype(jnp.float32), w[17].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(want).max()))


@on_gpu
def test_glm5_nvfp4_gate_up_of_256_experts_is_read_at_its_far_end():
    """GLM-5's gate_up [256, 4096, 6144] in NVFP4 (3 GiB of packed codes): rows routed to the last experts."""
    e, n, k = 256, 4096, 6144
    assert needs_words((e, n, k // 2), jnp.uint8)
    keys = jax.random.split(jax.random.key(2), 3)
    packed = jax.random.bits(keys[0], (e, n, k // 2), jnp.uint8)
    scales = jax.random.uniform(keys[1], (e, n, k // 16), minval=0.5, maxval=2.0).astype(jnp.float8_e4m3fn)
    gscale = jnp.full((e,), 1e-3, jnp.float32)
    sizes = np.zeros(e, np.int32)
    sizes[[0, 200, 255]] = [3, 4, 5]
    x = jax.random.normal(keys[2], (12, k), jnp.bfloat16)
    got = np.asarray(nvfp4_grouped_matmul(x, packed, scales, gscale, jnp.asarray(sizes), interpret=False),
                     np.float32)
    start = 0
    for expert, rows in ((0, 3), (200, 4), (255, 5)):
        w = dequantize_nvfp4(packed[expert], scales[expert], gscale[expert], jnp.float32)
        want = np.asarray(jnp.dot(x[start:start + rows].astype(jnp.float32), w.T,
                                  precision=jax.lax.Precision.HIGHEST))
        np.testing.assert_allclose(got[start:start + rows], want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
        start += rows
