"""jaxdp.ops: every backend of every op against its pure-jnp reference at tiny shapes (Pallas in interpret mode on
the CPU, native where the C++ compiler is present), the backend each platform gets by default, and the one
sentence that refuses an unknown or unavailable backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp import native
from jaxdp.ops import registry
from jaxdp.ops.attention import decode_kernels, mla_decode_xla, sparse_mla_decode_xla, write_rows
from jaxdp.ops.experts import routed_experts, routed_experts_nvfp4
from jaxdp.ops.gemm import lm_head_product, projection
from jaxdp.ops.nvfp4 import dequantize_nvfp4, quantize_nvfp4_experts
from jaxdp.ops.stacked import InStack, StackedWeight

NATIVE = native.available()
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native kernels are not built")


def ref_dot(eq, x, w):
    return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rng_array(seed, shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# ---- the table and the choice -------------------------------------------------------------------


def test_every_op_defaults_to_one_of_its_own_backends_on_every_platform():
    for name, op in registry.OPS.items():
        assert set(op.default) == set(registry.PLATFORMS), name
        for platform, backend in op.default.items():
            assert backend in op.backends and platform in registry.BACKENDS[backend], (name, platform)


@pytest.mark.parametrize("op,cpu,gpu", [
    ("projection_gemm", "native", "pallas"), ("expert_gemm", "auto", "pallas"), ("mla_decode", "native", "pallas"),
    ("sparse_mla_decode", "xla", "pallas"), ("prompt_attention", "xla", "xla"), ("lm_head", "native", "xla"),
    ("sampling", "xla", "xla")])
def test_the_default_per_platform(op, cpu, gpu):
    """Today's choices: a GPU runs the Pallas kernels, a CPU jaxdp's native ones where they are built (xla
    otherwise), whatever platform the test runs on (`platform` names it)."""
    assert registry.choose(op, None, "cpu") == (cpu if cpu != "native" or NATIVE else "xla")
    assert registry.choose(op, None, "gpu") == registry.choose(op, None, "cuda") == gpu
    assert registry.choose(op, None, "tpu") in ("xla", "auto")


def test_a_measured_winner_for_a_gpu_kind_comes_before_the_default(monkeypatch):
    monkeypatch.setattr(registry, "_winners_file", lambda: {"NVIDIA H200": {"projection_gemm": "xla"}})
    assert registry.choose("projection_gemm", None, "gpu", "NVIDIA H200") == "xla"
    assert registry.choose("projection_gemm", None, "gpu", "NVIDIA H100 80GB HBM3") == "pallas"
    assert registry.fp8_gemm_backend(None, "gpu", "NVIDIA H200") == "xla"
    assert registry.fp8_gemm_backend(None, "gpu", "NVIDIA H100 80GB HBM3") is None  # picked where lowered
    assert registry.choose("projection_gemm", "pallas", "gpu", "NVIDIA H200") == "pallas"  # the flag wins
    assert registry.winners(None) == {}


def test_the_shipped_winners_table_names_known_ops_and_backends():
    for kind, table in registry._winners_file().items():
        for op, backend in table.items():
            assert backend in registry.OPS[op].backends, (kind, op)


@pytest.mark.parametrize("flag,backend,platform,words", [
    ("--attention-backend", "flash", "cpu", "'flash' is not one of xla, pallas, native"),
    ("--moe-runner-backend", "deep_gemm", "gpu", "is not one of auto, xla, blocked, pallas, native"),
    ("--fp8-gemm-backend", "cutlass", "gpu", "is not one of xla, pallas, native"),
    ("--fp8-gemm-backend", "native", "gpu", "native does not run on a GPU: choose one of xla, pallas"),
    ("--attention-backend", "pallas", "tpu", "pallas does not run on a TPU: choose one of xla"),
])
def test_an_unknown_or_unavailable_backend_is_refused_in_one_sentence(flag, backend, platform, words):
    op = {"--attention-backend": "mla_decode", "--moe-runner-backend": "expert_gemm",
          "--fp8-gemm-backend": "projection_gemm"}[flag]
    with pytest.raises(ValueError) as e:
        registry.choose(op, backend, platform)
    message = str(e.value)
    assert message.startswith(flag) and words in message and "\n" not in message and message.count(". ") == 0


def test_native_without_its_kernels_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    with pytest.raises(ValueError, match=r"^--fp8-gemm-backend native needs jaxdp's native CPU kernels, .*: "
                                         r"choose one of xla, pallas$"):
        registry.choose("projection_gemm", "native", "cpu")
    assert registry.choose("mla_decode", None, "cpu") == "xla"  # the default steps aside quietly
    with pytest.raises(ValueError, match="--attention-backend native needs"):
        registry.check_flags("native", None, None, "cpu")


def test_a_flag_choice_an_op_lacks_runs_its_xla_form():
    """--attention-backend native: the sparse decode has no native kernel."""
    if NATIVE:
        assert registry.choose("sparse_mla_decode", "native", "cpu") == "xla"
    assert decode_kernels("pallas", "gpu").name == "pallas" and decode_kernels(None, "gpu").name == "pallas"
    assert decode_kernels("xla").sparse is sparse_mla_decode_xla


# ---- projection GEMM ----------------------------------------------------------------------------


def fp8_stack(seed, shape):
    """A block-FP8 stack [L, K, N] (128 x 128 blocks) and its scales, with the dequantized layers."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    L, K, N = shape
    blocks = np.abs(w.reshape(L, K // 128, 128, N // 128, 128)).max(axis=(2, 4)) / 448.0
    full = np.repeat(np.repeat(blocks, 128, 1), 128, 2)
    q = (w / full).astype(jnp.float8_e4m3fn)
    return jnp.asarray(q), jnp.asarray(blocks, jnp.float32), np.asarray(q, np.float32) * full


@pytest.mark.parametrize("backend", ["xla", "pallas", "native", None])
@pytest.mark.parametrize("kind", ["plain", "fp8"])
def test_projection_gemm_backends_equal_the_reference(backend, kind):
    if backend == "native" and not NATIVE:
        pytest.skip("no native kernels")
    layer = jnp.int32(1)
    if kind == "plain":
        values = rng_array(0, (3, 128, 64))
        w, dense = StackedWeight(values, None, layer), np.asarray(values[1])
    else:
        values, scales, dense_all = fp8_stack(1, (2, 256, 128))
        w, dense = StackedWeight(values, scales, layer, 128, jnp.dtype(jnp.float32)), dense_all[1]
    x = rng_array(2, (5, dense.shape[0]))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda x: projection("td,dn->tn", x, w, ref_dot, backend=backend))(x)
    np.testing.assert_allclose(got, np.asarray(x) @ dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["xla", "pallas", "native"])
def test_projection_gemm_per_head_over_a_view_of_columns(backend):
    """MLA's W_UK (contract the columns) over a view of kv_b_proj [A, H, X], read in place."""
    if backend == "native" and not NATIVE:
        pytest.skip("no native kernels")
    values = rng_array(3, (2, 128, 2, 64))
    w = StackedWeight(values, None, jnp.int32(1))[..., :32]
    q = rng_array(4, (3, 2, 32))
    with jax.default_matmul_precision("highest"):
        got = projection("bhn,lhn->bhl", q, w, ref_dot, backend=backend)
    want = np.einsum("bhn,lhn->bhl", np.asarray(q), np.asarray(values[1])[..., :32])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_lm_head_product_equals_the_reference():
    x, w = rng_array(5, (3, 32)), rng_array(6, (32, 48))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lm_head_product)(x, w)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)


# ---- grouped expert GEMM ------------------------------------------------------------------------


def expert_case(seed=7, T=6, E=4, D=32, I=16, K=2):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32).at[-1].set(E)  # the last row: padding
    w = jnp.asarray(rng.random((T, K)), jnp.float32).at[-1].set(0.0)
    gate_up = jnp.asarray(rng.standard_normal((2, E, D, 2, I)) / np.sqrt(D), jnp.float32)
    down = jnp.asarray(rng.standard_normal((2, E, I, D)) / np.sqrt(I), jnp.float32)
    return x, idx, w, gate_up, down


def experts_reference(x, idx, w, gate_up, down):
    """Row by row, choice by choice, in numpy."""
    x, idx, w, gate_up, down = (np.asarray(a, np.float64) for a in (x, idx, w, gate_up, down))
    E, y = gate_up.shape[0], np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < E:
                h = np.einsum("d,dxi->xi", x[t], gate_up[e])
                y[t] += w[t, k] * ((h[0] / (1 + np.exp(-h[0])) * h[1]) @ down[e])
    return y


@pytest.mark.parametrize("backend", ["auto", "xla", "blocked", "pallas", "native"])
def test_expert_gemm_backends_equal_the_reference(backend):
    if backend == "native" and not NATIVE:
        pytest.skip("no native kernels")
    x, idx, w, gate_up, down = expert_case()
    layer = jnp.int32(1)
    stacked = (StackedWeight(gate_up, None, layer), StackedWeight(down, None, layer))
    with jax.default_matmul_precision("highest"):
        y, rows = jax.jit(lambda x: routed_experts(x, idx, w, *stacked, 0, backend))(x)
    np.testing.assert_allclose(y, experts_reference(x, idx, w, gate_up[1], down[1]), rtol=1e-4, atol=1e-4)
    assert int(rows.sum()) == int((idx < 4).sum())


@pytest.mark.parametrize("backend", ["xla", "blocked", "pallas"])
def test_nvfp4_expert_gemm_backends_equal_the_dequantized_reference(backend):
    """NVFP4 experts (K a multiple of the 16-value scale block; the kernel's K tile needs 128): every backend
    against the numpy product of the dequantized experts."""
    rng = np.random.default_rng(11)
    T, E, D, I, K = 5, 2, 128, 128, 2
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    gu = quantize_nvfp4_experts(jnp.asarray(rng.standard_normal((E, 2 * I, D)), jnp.float32))
    dn = quantize_nvfp4_experts(jnp.asarray(rng.standard_normal((E, D, I)), jnp.float32))
    q = {"w_gate_up_packed": gu[0].reshape(E, 2, I, D // 2), "w_gate_up_scale": gu[1].reshape(E, 2, I, -1),
         "w_gate_up_gscale": gu[2], "w_down_packed": dn[0], "w_down_scale": dn[1], "w_down_gscale": dn[2]}
    stacked = {name: InStack(v[None], jnp.int32(0)) for name, v in q.items()}  # a one-layer stack, read in place
    got, _ = routed_experts_nvfp4(x, idx, w, stacked, 0, backend)
    gate_up = np.moveaxis(np.asarray(dequantize_nvfp4(*gu, jnp.float32)).reshape(E, 2, I, D), -1, 1)
    down = np.swapaxes(np.asarray(dequantize_nvfp4(*dn, jnp.float32)), 1, 2)
    want = experts_reference(x, idx, w, gate_up, down)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_an_unknown_expert_backend_is_refused():
    x, idx, w, gate_up, down = expert_case()
    with pytest.raises(ValueError, match=r"^--moe-runner-backend 'cutlass' is not one of auto, xla, blocked"):
        routed_experts(x, idx, w, gate_up[0], down[0], 0, "cutlass")


# ---- MLA decode ---------------------------------------------------------------------------------


def decode_case(B=3, H=16, L=64, R=16, P=12, S=4, N=3):
    rng = np.random.default_rng(5)
    q_latent = jnp.asarray(rng.standard_normal((B, H, L)), jnp.float32)
    q_rope = jnp.asarray(rng.standard_normal((B, H, R)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((P, S, L + R)), jnp.float32)
    table = jnp.asarray(rng.permutation(P)[:B * N].reshape(B, N), jnp.int32)
    lens = jnp.asarray([5, 0, 12], jnp.int32)
    return q_latent, q_rope, kv, table, lens


def decode_reference(q_latent, q_rope, kv, table, lens, scale, L):
    q = np.concatenate([np.asarray(q_latent), np.asarray(q_rope)], -1).astype(np.float64)
    out = np.zeros(np.asarray(q_latent).shape)
    ctx = np.asarray(kv)[np.asarray(table)].reshape(table.shape[0], -1, kv.shape[-1]).astype(np.float64)
    for b, n in enumerate(np.asarray(lens)):
        if n:
            s = scale * q[b] @ ctx[b, :n].T
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b] = (p / p.sum(-1, keepdims=True)) @ ctx[b, :n, :L]
    return out


@pytest.mark.parametrize("backend", ["xla", "pallas", "native"])
def test_mla_decode_backends_equal_the_reference(backend):
    if backend == "native" and not NATIVE:
        pytest.skip("no native kernels")
    args = decode_case()
    kernels = decode_kernels(backend, "cpu")
    assert kernels.name == backend
    with jax.default_matmul_precision("highest"):
        got = np.asarray(kernels(*args, softmax_scale=0.125, kv_lora_rank=64))
    live = np.asarray(args[-1]) > 0  # (a row of no length: zeros from the kernels, discarded from xla's)
    np.testing.assert_allclose(got[live], decode_reference(*args, 0.125, 64)[live], rtol=1e-4, atol=1e-4)
    if backend != "xla":
        assert not got[~live].any()


@pytest.mark.parametrize("backend", ["xla", "pallas", "native"])
def test_sparse_mla_decode_backends_equal_the_dense_decode_over_the_selection(backend):
    """Selecting every position a row has gives the dense decode's result."""
    if backend == "native" and not NATIVE:
        pytest.skip("no native kernels")
    q_latent, q_rope, kv, table, lens = decode_case()
    S = kv.shape[1]
    pos = jnp.arange(table.shape[1] * S)[None, :]
    slots = jnp.take_along_axis(table, pos // S, axis=1) * S + pos % S
    with jax.default_matmul_precision("highest"):
        got = decode_kernels(backend, "cpu").sparse(q_latent, q_rope, kv, slots, lens, softmax_scale=0.125,
                                                    kv_lora_rank=64)
        want = mla_decode_xla(q_latent, q_rope, kv, table, lens, softmax_scale=0.125, kv_lora_rank=64)
    np.testing.assert_allclose(np.asarray(got)[np.asarray(lens) > 0], np.asarray(want)[np.asarray(lens) > 0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cache_rows_written_equal_the_scatter_and_bf16_stays_bf16_on_a_cpu(dtype):
    """`write_rows` equals XLA's scatter for every dtype; a bf16 cache on a CPU is written by the native kernel,
    so the compiled step holds no float32 copy of the cache (XLA:CPU's bf16 scatter converts it whole)."""
    rng = np.random.default_rng(4)
    cache = jnp.asarray(rng.standard_normal((8, 4, 64)), dtype)
    rows = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    slots = jnp.asarray([0, 31, 7, 32, 9], jnp.int32)  # 32: past the 32 slots, dropped
    want = cache.reshape(32, 64).at[slots].set(rows.astype(dtype), mode="drop").reshape(8, 4, 64)
    step = jax.jit(write_rows)
    np.testing.assert_array_equal(np.asarray(step(cache, slots, rows), np.float32), np.asarray(want, np.float32))
    if dtype == jnp.bfloat16 and native.available():
        hlo = step.lower(cache, slots, rows).compile().as_text()
        assert "jaxdp_cache_write" in hlo and "f32[32,64]" not in hlo and "f32[8,4,64]" not in hlo
