"""The routed experts read only the experts some row chose (`--moe-runner-backend auto`, the CPU's default):
few rows gather their experts' weights, many rows run blocked; neither multiplies an expert no row chose."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdp.config import PRESETS
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.decoder import DeepseekV3
from jaxdp.one_batch import run_prompts
from jaxdp.ops.experts import gathered_experts, gathers, routed_experts
from jaxdp.parallel.step import StepRunner


@pytest.mark.parametrize("offset", [0, 3])  # 3: experts 3..26 held here (0 and 2 are another device's, as under EP)
def test_gathered_experts_equal_the_grouped_product(offset):
    rng = np.random.default_rng(offset)
    T, K, E, D, I = 3, 2, 24, 16, 8
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    idx = jnp.asarray([[0, 4], [8, 5], [6, 2]], jnp.int32)
    idx = idx.at[2].set(99)  # row 2 is padding: the sentinel expert (past every expert), weight 0
    w = jnp.asarray(rng.uniform(size=(T, K)), jnp.float32).at[2].set(0.0)
    gu = jnp.asarray(rng.normal(size=(E, D, 2, I)), jnp.float32)
    down = jnp.asarray(rng.normal(size=(E, I, D)), jnp.float32)
    assert gathers("auto", T * K, E) and not gathers("auto", E, E, 1 << 20) and not gathers("xla", 1, E)
    assert gathers("auto", 4 * E, E, 1 << 10)  # small gathered weights
    with jax.default_matmul_precision("highest"):
        got, rows_got = jax.jit(gathered_experts, static_argnums=5)(x, idx, w, gu, down, offset)
        want, rows_want = jax.jit(routed_experts, static_argnums=(5, 6))(x, idx, w, gu, down, offset, "xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(rows_got), np.asarray(rows_want))
    # experts no pair chose hold NaN: the gathered product never reads them, ragged_dot multiplies them by zeros
    unchosen = ~np.isin(np.arange(E) + offset, np.asarray(idx))
    gu_nan, down_nan = gu.at[unchosen].set(jnp.nan), down.at[unchosen].set(jnp.nan)
    nan_got, _ = jax.jit(gathered_experts, static_argnums=5)(x, idx, w, gu_nan, down_nan, offset)
    np.testing.assert_array_equal(np.asarray(nan_got), np.asarray(got))
    nan_ragged, _ = jax.jit(routed_experts, static_argnums=(5, 6))(x, idx, w, gu_nan, down_nan, offset, "xla")
    assert not np.isfinite(np.asarray(nan_ragged)).all()


CFG = PRESETS["tiny"].with_(n_routed_experts=32, num_experts_per_tok=2)  # most experts go unchosen


def _run(model, backend: str, chosen: np.ndarray | None = None):
    """Logits of one prompt and three decode steps; `chosen` collects the experts any step's rows chose."""
    lay = parse_mesh_spec("dp=1")
    runner = StepRunner(model, lay, lay.make_mesh(jax.devices()[:1]), num_pages=4, page_size=8, moe_backend=backend)
    run = runner.run

    def counting_run(shape, stacked, prev_tokens=None):
        logits, rows_E = run(shape, stacked, prev_tokens)
        if chosen is not None:
            chosen[:] |= np.asarray(rows_E).reshape(-1) > 0
        return logits, rows_E

    runner.run = counting_run
    with jax.default_matmul_precision("highest"):
        out = run_prompts(runner, [[5, 9]], [0], 3)
    return np.concatenate(out["prompt"] + out["decode"])


@pytest.mark.parametrize("backend", ["auto", "blocked"])
def test_unchosen_experts_are_never_read(backend):
    """A prompt and three decode steps through the compiled step: with every expert no step chose holding NaN,
    the logits stay finite and equal the clean model's, on the default path (few rows: gathered) and the blocked
    one (many rows; each block reads its expert where it lies in the layer stack). The product per expert of
    lax.ragged_dot, "xla", would read them: the test above shows it turning NaN."""
    model = DeepseekV3(CFG, nnx.Rngs(3))
    chosen = np.zeros(CFG.n_routed_experts, bool)
    clean = _run(model, backend, chosen)
    assert 0 < chosen.sum() <= CFG.n_routed_experts // 2, chosen
    for name in ("w_gate_up_ED2I", "w_down_EID"):
        p = getattr(model.moe_layers.ffn, name)
        p.set_value(p.get_value().at[:, ~chosen].set(jnp.nan))
    poisoned = _run(model, backend)
    assert np.isfinite(poisoned).all()
    np.testing.assert_array_equal(poisoned, clean)
