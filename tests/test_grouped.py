"""The blocked grouped matmul (`--moe-runner-backend blocked`): lax.ragged_dot's products, exactly, without
its expansion into a product per group over every row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import load_model
from jaxdp.one_batch import run_prompts
from jaxdp.ops.grouped import block_rows, grouped_matmul
from jaxdp.parallel.step import StepRunner

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 500]]


@pytest.mark.parametrize("sizes,rows,block", [
    ([5, 0, 17, 3], 25, None),  # an empty group
    ([5, 0, 17, 3], 40, 8),  # rows past the last group give zeros
    ([0, 0, 0], 6, None),  # no row in any group
    ([64], 64, 16),  # one group, whole blocks
    ([1] * 12, 12, 8),  # many one-row groups: a block each
    ([30, 2, 9, 0, 0, 41], 90, 128),  # a block larger than every group
])
def test_grouped_matmul_equals_ragged_dot(sizes, rows, block):
    rng = np.random.default_rng(len(sizes) + rows)
    E, K, N = len(sizes), 24, 40
    x = jnp.asarray(rng.integers(-4, 5, (rows, K)), jnp.float32)  # small integers: both sums are exact
    w = jnp.asarray(rng.integers(-4, 5, (E, K, N)), jnp.float32)
    sz = jnp.asarray(sizes, jnp.int32)
    want = jax.lax.ragged_dot(x, w, sz, preferred_element_type=jnp.float32)
    got = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, block=block))(x, w, sz)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_block_rows_follows_the_mean_group():
    assert block_rows(32768, 256) == 128 and block_rows(4096, 256) == 16 and block_rows(10, 64) == 8
    assert block_rows(1 << 20, 8) == 128


def test_temporaries_do_not_grow_with_the_groups():
    """XLA's ragged_dot keeps a [rows, groups x width] product; the blocked form the padded rows only. At 4,096
    rows, 64 experts and widths 1,024 -> 512 (abstract: compiled, never run; float32, since XLA:CPU would
    convert bf16 weights to float32 whole before its dots, which a GPU does not)."""
    M, E, K, N = 4096, 64, 1024, 512
    args = (jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((E, K, N), jnp.float32),
            jax.ShapeDtypeStruct((E,), jnp.int32))

    def temp(fn) -> int:
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    ragged = temp(lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=jnp.float32))
    blocked = temp(lambda x, w, s: grouped_matmul(x, w, s, preferred_element_type=jnp.float32))
    padded_rows = M + E * block_rows(M, E)
    assert blocked <= 2 * padded_rows * (K + N) * 4 + (1 << 20), blocked
    assert ragged >= M * E * N * 4 and blocked * 8 < ragged, (ragged, blocked)


@pytest.fixture(scope="module")
def dense():
    return load_model("tiny", "float32", seed=7)[1]


def logits(model, spec: str, backend: str | None) -> np.ndarray:
    lay = parse_mesh_spec(spec)
    with jax.default_matmul_precision("highest"):
        runner = StepRunner(model, lay, lay.make_mesh(jax.devices()[: lay.world]), num_pages=8, page_size=8,
                            moe_backend=backend)
        out = run_prompts(runner, PROMPTS, [i % lay.dp for i in range(len(PROMPTS))], 4)
    return np.concatenate(out["prompt"] + out["decode"])


@pytest.mark.parametrize("spec", ["tp=2", "dp=2,moe=ep"])
def test_blocked_backend_in_the_sharded_step_equals_ragged_dot(dense, spec):
    np.testing.assert_allclose(logits(dense, spec, "blocked"), logits(dense, spec, "xla"), atol=2e-5, rtol=0)
