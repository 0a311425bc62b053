"""jaxdp.native: the CPU's grouped product reading a layer (and an expert) where it lies in its stack, against
numpy; the model's products take it on a CPU (custom call in the compiled step) and still differentiate; a
machine without a compiler falls back in one log line."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp import native
from jaxdp.model.layers import dot
from jaxdp.ops.gemm import einsum
from jaxdp.ops.stacked import StackedWeight

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: the native kernels are not built")


def _reference(x, w_LEKN, layer, sizes):
    """numpy, float64: each group's rows times its matrix; rows past the groups 0."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w_LEKN[layer], np.float64)
    y = np.zeros((x.shape[0], w64.shape[-1]))
    row = 0
    for e, n in enumerate(np.asarray(sizes)):
        y[row:row + n] = x64[row:row + n] @ w64[e]
        row += n
    return y


@pytest.mark.parametrize("x_dtype, w_dtype", [(jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16),
                                              (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("sizes, rows, n", [
    ([3, 0, 7, 1, 13], 30, 80),  # empty groups, every row count 1..13 (tiles of 6, 5, 4, ...), 6 rows past them
    ([1, 1, 1, 1, 1], 5, 16),    # one row each, one vector of columns
    ([0, 0, 0, 0, 0], 4, 64),    # no group: zeros
    ([2, 2, 2, 2, 40], 48, 128),  # more rows than any tile, two column tasks
])
def test_grouped_matmul_equals_numpy(x_dtype, w_dtype, sizes, rows, n):
    rng = np.random.default_rng(len(sizes) + rows + n)
    L, E, K = 3, len(sizes), 40
    x = jnp.asarray(rng.normal(size=(rows, K)), x_dtype)
    w = jnp.asarray(rng.normal(size=(L, E, K, n)), w_dtype)
    sizes = jnp.asarray(sizes, jnp.int32)
    for layer in (0, 2):
        got = jax.jit(native.grouped_matmul)(x, w, layer, sizes)
        assert got.dtype == jnp.float32 and got.shape == (rows, n)
        want = _reference(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), layer, sizes)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_only_the_chosen_groups_are_read():
    """Groups with no rows are never read: they hold NaN and the product stays finite (a product per group over
    every row, as lax.ragged_dot's, would turn it NaN)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 4, 32, 48)).astype(np.float32)
    w[1, [0, 2]] = np.nan  # layer 1's experts 0 and 2: no rows
    w[0] = np.nan  # another layer: never read
    x = jnp.asarray(rng.normal(size=(5, 32)), jnp.float32)
    sizes = jnp.asarray([0, 3, 0, 2], jnp.int32)
    got = np.asarray(jax.jit(native.grouped_matmul)(x, jnp.asarray(w), 1, sizes))
    np.testing.assert_allclose(got, _reference(np.asarray(x), np.nan_to_num(w), 1, sizes), rtol=1e-5, atol=1e-4)


def test_a_stacked_weight_multiplies_natively_and_differentiates():
    """A Linear weight the layer scan hands whole (`StackedWeight`) is multiplied on a CPU by the custom call,
    reading its layer in place (no dynamic slice of the stack in the compiled step); the product equals the
    dense one, and its derivative is the dense product's (training)."""
    rng = np.random.default_rng(1)
    stack = jnp.asarray(rng.normal(size=(4, 24, 3, 16)), jnp.float32)  # [L, D, H, K]
    x = jnp.asarray(rng.normal(size=(5, 24)), jnp.float32)

    def f(x, stack, layer):
        return dot("td,dhk->thk", x, StackedWeight(stack, None, layer))

    hlo = jax.jit(f).lower(x, stack, 2).compile().as_text()
    assert native.TARGET in hlo and "dynamic-slice" not in hlo
    with jax.default_matmul_precision("highest"):
        want = jnp.einsum("td,dhk->thk", x, stack[2])
        np.testing.assert_allclose(np.asarray(jax.jit(f)(x, stack, 2)), np.asarray(want), rtol=1e-5, atol=1e-5)
        g = jax.grad(lambda x: f(x, stack, 2).sum())(x)
        np.testing.assert_allclose(np.asarray(g), np.asarray(stack[2].sum((1, 2)))[None].repeat(5, 0), rtol=1e-5)
        # a view of some columns, or an einsum of another form, keeps the dense product
        view = jax.jit(lambda x, s: einsum("td,dhk->thk", x, StackedWeight(s, None, 1)[..., 4:12]))
        assert native.TARGET not in view.lower(x, stack).compile().as_text()


def test_under_vmap():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    xs = jnp.asarray(rng.normal(size=(3, 4, 8)), jnp.float32)
    got = jax.vmap(lambda x: native.matmul(x, w, 1))(xs)
    np.testing.assert_allclose(np.asarray(got), np.einsum("bmk,kn->bmn", xs, w[1]), rtol=1e-5, atol=1e-5)


def test_no_compiler_means_no_native_kernels(monkeypatch, tmp_path, caplog):
    """Where the build cannot run, the build says why and loading says so in one log line (the products stay
    XLA's); JAXDP_NATIVE=0 turns the kernels off, and back on, without loading them twice."""
    monkeypatch.setenv("JAXDP_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(OSError):
        native._build()
    with caplog.at_level(logging.WARNING, logger="jaxdp.native"):
        assert native._load.__wrapped__() is False  # the uncached load, as a machine without a compiler runs it
    assert len(caplog.records) == 1 and "not built" in caplog.records[0].getMessage()
    monkeypatch.setenv(native.ENV, "0")
    assert not native.available()
    x, w = jnp.ones((2, 16)), jnp.ones((16, 32))
    assert native.TARGET not in jax.jit(native.dense_matmul).lower(x, w).compile().as_text()
    monkeypatch.undo()
    assert native.available() and native._load.cache_info().misses <= 1


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 20])  # 20: W_UK transposed first (kTransposeRows)
def test_head_products_equal_numpy(w_dtype, rows):
    """MLA's per-head products with a view of kv_b_proj's columns, read in place: W_UK (the columns transposed,
    contract "B") and W_UV (contract "A"), through `StackedWeight.dot` as the model calls them."""
    rng = np.random.default_rng(rows)
    L, A, H, N, V = 3, 32, 4, 16, 48  # [L, A, H, N + V]: kv_b_proj's layout
    stack = jnp.asarray(rng.normal(size=(L, A, H, N + V)), w_dtype)
    w64 = np.asarray(stack.astype(jnp.float32), np.float64)[1]
    q = jnp.asarray(rng.normal(size=(rows, H, N)), jnp.float32)
    o = jnp.asarray(rng.normal(size=(rows, H, A)), jnp.float32)
    w = StackedWeight(stack, None, 1)
    uk = jax.jit(lambda q, s: dot("bhn,lhn->bhl", q, StackedWeight(s, None, 1)[..., :N]))
    uv = jax.jit(lambda o, s: dot("bhl,lhv->bhv", o, StackedWeight(s, None, 1)[..., N:]))
    assert native.HEAD_TARGET in uk.lower(q, stack).compile().as_text()
    np.testing.assert_allclose(np.asarray(uk(q, stack)), np.einsum("bhn,lhn->bhl", q, w64[..., :N]), rtol=1e-5,
                               atol=1e-4)
    np.testing.assert_allclose(np.asarray(uv(o, stack)), np.einsum("bhl,lhv->bhv", o, w64[..., N:]), rtol=1e-5,
                               atol=1e-4)
    assert w.shape == (A, H, N + V)


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_mla_decode_equals_the_xla_decode(cache_dtype):
    """The native absorbed decode reads each row's entries through its page table and equals `mla_decode_xla`
    (rows of every length: within a page, across pages, none); entries past a row's length hold NaN and are
    never read."""
    from jaxdp.ops.attention import mla_decode_native as mla_decode_portable
    from jaxdp.ops.attention import mla_decode_xla

    rng = np.random.default_rng(3)
    B, H, Lk, R, P, S, N = 5, 3, 64, 16, 16, 4, 3
    kv = rng.normal(size=(P, S, Lk + R)).astype(np.float32)
    table = rng.permutation(P)[:B * N].reshape(B, N).astype(np.int32)
    lens = np.asarray([1, 4, 7, 12, 0], np.int32)
    for b in range(B):  # every slot past the row's length: NaN
        for c in range(lens[b], N * S):
            kv[table[b, c // S], c % S] = np.nan
    q_lat = jnp.asarray(rng.normal(size=(B, H, Lk)), jnp.float32)
    q_rope = jnp.asarray(rng.normal(size=(B, H, R)), jnp.float32)
    kv_j = jnp.asarray(kv, cache_dtype)
    f = jax.jit(lambda *a: mla_decode_portable(*a, softmax_scale=0.3, kv_lora_rank=Lk))
    assert native.DECODE_TARGET in f.lower(q_lat, q_rope, kv_j, table, lens).compile().as_text()
    got = np.asarray(f(q_lat, q_rope, kv_j, table, lens).astype(jnp.float32))
    clean = jnp.asarray(np.nan_to_num(kv), cache_dtype)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(mla_decode_xla(q_lat, q_rope, clean, table, lens, softmax_scale=0.3,
                                         kv_lora_rank=Lk).astype(jnp.float32))
    tol = 1e-5 if cache_dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got[:4], want[:4], rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[4], 0)


def test_dense_matmul_is_native_on_a_cpu_and_differentiates():
    """The LM head's product (a weight held whole, [K, N]): the custom call on a CPU, XLA's derivative."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(3, 24)), jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jnp.asarray(rng.normal(size=(24, 48)), dtype)
        f = jax.jit(native.dense_matmul)
        assert native.TARGET in f.lower(x, w).compile().as_text()
        want = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
        np.testing.assert_allclose(np.asarray(f(x, w)), want, rtol=1e-5, atol=1e-4)
    g = jax.grad(lambda x: native.dense_matmul(x, w.astype(jnp.float32)).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w.astype(jnp.float32)).sum(1)[None].repeat(3, 0),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cache_write_puts_rows_in_their_slots_in_place(dtype):
    """`cache_write` writes each row into its slot of the cache's flattened leading dims (a slot out of range
    dropped), as XLA's scatter does, and in the compiled step the result aliases the cache (no copy of it)."""
    rng = np.random.default_rng(3)
    cache = jnp.asarray(rng.standard_normal((4, 3, 32)), dtype)
    rows = jnp.asarray(rng.standard_normal((3, 32)), dtype)
    slots = jnp.asarray([5, 12, 0], jnp.int32)  # 12: past the 12 slots, dropped
    want = np.asarray(cache.reshape(12, 32).at[slots].set(rows, mode="drop").reshape(4, 3, 32), np.float32)
    step = jax.jit(native.cache_write, donate_argnums=0)
    assert "output_to_operand_aliasing" in step.lower(cache, slots, rows).compile().as_text()
    got = step(jnp.array(cache), slots, rows)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
