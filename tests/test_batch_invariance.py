"""The batch-invariant forms behind --enable-deterministic-inference (docs/determinism.md): each equals its plain
jnp reference within float32 rounding, and a row's result is bit-identical whatever the number of rows beside it
(the first T rows computed at T = 1 .. 64 against the same rows computed at T = 64)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp import native
from jaxdp.bench.invariance import op_table
from jaxdp.model.layers import rms_norm
from jaxdp.ops.experts import routed_experts
from jaxdp.ops.rows import log_softmax, row_max, row_sum
from jaxdp.ops.stacked import StackedWeight

ROWS = (1, 3, 17, 64)
needs_native = pytest.mark.skipif(not native.available(), reason="jaxdp's native CPU kernels are not built here")


def row_invariant(f, x) -> bool:
    full = np.asarray(jax.jit(f)(x))
    return all(np.array_equal(np.asarray(jax.jit(f)(x[:T])), full[:T]) for T in ROWS)


def rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("width", [5, 64])
def test_row_reductions_match_jnp_and_are_row_invariant(width):
    x = rand(64, width)
    np.testing.assert_allclose(row_sum(x), jnp.sum(x, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(row_max(x), jnp.max(x, -1))
    np.testing.assert_allclose(log_softmax(x), jax.nn.log_softmax(x, -1), rtol=1e-5, atol=1e-5)
    assert row_invariant(row_sum, x) and row_invariant(log_softmax, x)
    w = rand(width, seed=1)
    ref = w * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-6)
    if width % 16 == 0:  # (a norm of a width off XLA's vector width can still vary: docs/determinism.md)
        assert row_invariant(lambda x: rms_norm(x, w, 1e-6), x)


@needs_native
@pytest.mark.parametrize("n", [8, 70])
def test_native_product_takes_any_width_row_invariantly(n):
    """Widths that are not a multiple of 16 (a sliced expert: 8 columns a device) run natively, exact to XLA's
    product within rounding, and a row's result does not depend on the rows beside it."""
    x, w = rand(64, 48), rand(48, n, seed=1)
    np.testing.assert_allclose(native.dense_matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert row_invariant(lambda x: native.dense_matmul(x, w), x)


@needs_native
def test_native_w_uk_product_is_row_invariant_past_16_rows():
    w = rand(2, 64, 4, 48)  # [L, A, H, X]
    x = rand(64, 4, 16, seed=1)
    ref = jnp.einsum("bhn,ahn->bha", x, w[1, :, :, 8:24])
    np.testing.assert_allclose(native.head_matmul(x, w, 1, 8, 16, "B"), ref, rtol=1e-5, atol=1e-5)
    assert row_invariant(lambda x: native.head_matmul(x, w, 1, 8, 16, "B"), x)


@needs_native
def test_routed_experts_combine_is_row_invariant():
    """A row's routed result (its 2 choices among 8 experts of 8 columns, weighted and added) is the dense
    reference's within rounding, and the same bits whatever rows are routed with it."""
    E, D, I, K = 8, 32, 4, 2
    gate_up, down = rand(1, E, D, 2, I, seed=2), rand(1, E, I, D, seed=3)
    w1, w2 = StackedWeight(gate_up, None, jnp.int32(0)), StackedWeight(down, None, jnp.int32(0))
    rng = np.random.default_rng(4)
    idx = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(64)]), jnp.int32)
    wts = jnp.asarray(rng.uniform(size=(64, K)), jnp.float32)
    x = rand(64, D, seed=5)

    def run(x, idx, wts):
        return routed_experts(x, idx, wts, w1, w2, backend="native")[0]

    h = jnp.einsum("td,tkdxi->tkxi", x, gate_up[0][idx])
    ref = jnp.einsum("tki,tkid,tk->td", jax.nn.silu(h[:, :, 0]) * h[:, :, 1], down[0][idx], wts)
    np.testing.assert_allclose(run(x, idx, wts), ref, rtol=1e-4, atol=1e-4)
    full = np.asarray(jax.jit(run)(x, idx, wts))
    for T in ROWS:
        assert np.array_equal(np.asarray(jax.jit(run)(x[:T], idx[:T], wts[:T])), full[:T]), T


@pytest.mark.slow
def test_the_probe_table_shows_what_it_says():
    """`python -m jaxdp.bench.invariance --ops`: XLA's forms vary with the rows, the replacements do not (slow:
    about a minute of compiles on 2 cores)."""
    table = dict(op_table())
    assert table["XLA dot [T, 256] x [256, 8] (the router)"]
    assert table["XLA segment_sum of row pairs [T, 256] (the MoE's combine before)"]
    assert table["rows.row_sum / rms_norm [T, 64] (now)"] == [] and table["rows.log_softmax [T, 512] (now)"] == []
