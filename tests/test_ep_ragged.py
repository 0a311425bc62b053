"""EP dispatch/combine: the ragged form (XLA:GPU's `ragged_all_to_all`) gives what the fixed-capacity
form gives (the XLA:CPU path, its reference) and what one device computes with every expert.

`ragged_all_to_all` does not run on XLA:CPU, so the ragged form runs here with an exchange of the same
semantics built from all-gathers: the offsets and sizes each device computes are what is tested.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.layout import Layout
from jaxdp.model.moe import routed_experts
from jaxdp.parallel.places import ALL, dispatch_combine_moe, ragged_a2a_on, ragged_dispatch_combine_moe


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """lax.ragged_all_to_all's semantics: source s's chunk for me, operand_s[input_offsets_s[me]:][:n],
    lands at output[output_offsets_s[me]:][:n], n = recv_sizes[s] (which must equal send_sizes_s[me])."""
    ops = jax.lax.all_gather(operand, axis_name)
    in_off, sizes, out_off = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis_name)
    i = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        start, n = out_off[s, me], recv_sizes[s]
        rows = ops[s][jnp.clip(in_off[s, me] + i - start, 0, ops.shape[1] - 1)]
        take = (i >= start) & (i < start + n) & (n == sizes[s, me])
        output = jnp.where(take.reshape(-1, *([1] * (output.ndim - 1))), rows, output)
    return output


@dataclasses.dataclass
class HeldExperts:
    w_gate_up_ED2I: jax.Array
    w_down_EID: jax.Array

    @property
    def num_local_experts(self) -> int:
        return self.w_gate_up_ED2I.shape[0]

    def experts(self, x_TD, idx_TK, w_TK):
        return routed_experts(x_TD, idx_TK, w_TK, self.w_gate_up_ED2I, self.w_down_EID)


@pytest.mark.parametrize("T", [6])
def test_ragged_dispatch_matches_fixed_capacity_and_one_device(T):
    layout = Layout(dp=4, tp=2, moe="ep")
    mesh = layout.make_mesh(jax.devices()[:8])
    W, E, K, D, I = 8, 16, 3, 16, 8
    rng = np.random.default_rng(0)
    h = rng.standard_normal((W, T, D)).astype(np.float32)
    idx = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(T)]) for _ in range(W)]).astype(np.int32)
    idx[1:3, -1] = E  # padding rows carry the sentinel expert
    idx[5] = rng.integers(0, 2, (T, K))  # one device's rows all go to device 0's experts
    w = rng.random((W, T, K)).astype(np.float32)
    wg = (rng.standard_normal((E, D, 2, I)) / 4).astype(np.float32)
    wd = (rng.standard_normal((E, I, D)) / 4).astype(np.float32)

    def per_device(h, idx, w, wg, wd):
        moe = HeldExperts(wg, wd)
        y_fixed, rows_fixed = dispatch_combine_moe(h[0], idx[0], w[0], moe, W)
        y_ragged, rows_ragged = ragged_dispatch_combine_moe(h[0], idx[0], w[0], moe, W,
                                                            exchange=emulated_ragged_all_to_all)
        return y_fixed[None], y_ragged[None], rows_fixed[None], rows_ragged[None]

    spec = P(ALL)
    put = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (h, idx, w, wg, wd)]
    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 4))
    y_fixed, y_ragged, rows_fixed, rows_ragged = (np.asarray(a) for a in fn(*put))

    np.testing.assert_allclose(y_ragged, y_fixed, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(rows_ragged, rows_fixed)
    want = np.stack([np.asarray(routed_experts(h[d], idx[d], jnp.where(idx[d] < E, w[d], 0.0), wg, wd)[0])
                     for d in range(W)])
    np.testing.assert_allclose(y_ragged, want, rtol=1e-5, atol=1e-5)
    assert rows_ragged.sum() == (idx < E).sum()


def test_the_ragged_form_is_chosen_on_gpus_only():
    assert ragged_a2a_on("gpu") and not ragged_a2a_on("cpu")


def test_the_ragged_form_lowers_for_cuda_with_three_ragged_all_to_alls():
    """XLA:CPU cannot run it, but JAX lowers it for a GPU here: dispatch (rows, expert ids) and combine."""
    mesh = Layout(dp=8, moe="ep").make_mesh(jax.devices()[:8])

    def per_device(h, idx, w, wg, wd):
        y, rows = ragged_dispatch_combine_moe(h[0], idx[0], w[0], HeldExperts(wg, wd), 8)
        return y[None], rows[None]

    spec = P(ALL)
    sh = NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in [
        ((8, 4, 16), jnp.bfloat16), ((8, 4, 2), jnp.int32), ((8, 4, 2), jnp.float32),
        ((16, 16, 2, 8), jnp.bfloat16), ((16, 8, 16), jnp.bfloat16)]]
    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, spec)))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("ragged_all_to_all") == 3 and "stablehlo.all_to_all" not in text  # the fixed form's op
