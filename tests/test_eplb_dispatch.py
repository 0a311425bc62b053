"""Dynamic expert dispatch (`--ep-dispatch-algorithm dynamic`, issue 47 point 1): inside the step, each replicated
expert's (row, choice) pairs are split over its replicas so that the devices' loads stay even, from every device's
pairs per expert (an all-gather of E counts), the same split on every device; nothing compiles when the map changes.

Independent checks: simulated on the host over 8 devices, every pair goes to a slot holding its expert, padding to
none, and the pairs each device receives (counted by numpy) peak no higher than under static dispatch on skewed
batches; in the step under EP layouts, the logits equal static dispatch's (the replicas hold the same weights) and the
rows the devices' experts receive, as the step reports them, peak no higher than static's on a rigged skewed router.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.eplb import dispatch
from jaxdp.eplb.algorithm import PlacementError
from jaxdp.eplb.distribution import RecorderError, check_dispatch_flags
from jaxdp.eplb.placement import ExpertPlacement
from jaxdp.eplb.slots import map_arrays, with_expert_slots
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import load_model
from jaxdp.model.moe import dynamic_slots
from jaxdp.model.sharded import shard_model
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.serve import build_parser, serve_config
from jaxdp.serve_config import UserError

E, W, R, K = 8, 8, 8, 2
PAGE, NPAGES, PAGES_PER_SEQ, T, B = 8, 16, 2, 16, 4
SKEW = np.array([[5, 1, 2, 90, 7, 1, 30, 3], [1, 60, 2, 2, 40, 9, 1, 1]], np.int64)


def static_slots(idx_WTK, slots_ES, replicas_E):
    """Static dispatch as the step does it (MoE.physical_choices): replica (global row + choice) mod count."""
    Wn, Tn, Kn = idx_WTK.shape
    out = np.full(idx_WTK.shape, slots_ES.shape[0] + slots_ES.shape[1] - 1, np.int64)
    for w, t, k in np.ndindex(Wn, Tn, Kn):
        e = idx_WTK[w, t, k]
        if e < slots_ES.shape[0]:
            out[w, t, k] = slots_ES[e, (w * Tn + t + k) % replicas_E[e]]
    return out


DYNAMIC = jax.jit(dynamic_slots, static_argnums=5)


def device_loads(slot_WTK, num_physical: int) -> np.ndarray:
    live = slot_WTK < num_physical
    return np.bincount(slot_WTK[live] // (num_physical // W), minlength=W)


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_dispatch_sends_every_pair_to_its_expert_and_evens_the_devices(seed):
    rng = np.random.default_rng(seed)
    load = rng.permutation(1.0 / np.arange(1, E + 1) ** 1.5) * 1000  # a zipf-like skew
    placement = ExpertPlacement.from_load(np.rint(load)[None].astype(np.int64) + 1, R, W)
    if seed % 3 == 0:  # a placement decided for another load than the batch's
        placement = ExpertPlacement.from_load(SKEW[:1], R, W)
    slots, replicas = (a[0] for a in map_arrays(placement))
    rows = 24  # (one shape: compiled once for every seed)
    idx = np.stack([np.stack([rng.choice(E, K, replace=False, p=load / load.sum()) for _ in range(rows)])
                    for _ in range(W)])
    idx[:, rows - int(rng.integers(0, 8)):] = E  # padding rows: the sentinel
    counts = np.stack([np.bincount(i[i < E], minlength=E) for i in idx])
    got = np.stack([np.asarray(DYNAMIC(jnp.asarray(idx[w]), jnp.asarray(counts), w, jnp.asarray(slots),
                                  jnp.asarray(replicas), E + R)) for w in range(W)])
    live = idx < E
    assert (got[~live] == E + R).all()
    assert (placement.physical_to_logical[0][got[live]] == idx[live]).all()  # a replica of its own expert
    dynamic, static = device_loads(got, E + R), device_loads(static_slots(idx, slots, replicas), E + R)
    assert dynamic.sum() == static.sum() == live.sum()
    assert dynamic.max() <= static.max(), (dynamic, static)
    assert dynamic.max() <= -(-live.sum() // W) + max(counts.sum(0)[replicas == 1].max(initial=0), 1)


def test_the_split_of_a_hand_worked_case():
    # 2 devices of 2 slots: expert 0 on slots 0 and 2 (both devices), expert 1 on slot 1 (device 0), expert 2 on
    # slot 3 (device 1). 6 pairs of expert 0, 4 of expert 1, none of 2: base loads (4, 0); water-filling expert 0's 6
    # raises device 1 to 4, then one each: device 0 gets 1, device 1 gets 5, the loads (5, 5). The pairs are numbered
    # device by device: device 0's three of expert 0 are pairs 0-2 (its first replica's one, then slot 2), device 1's
    # are 3-5 (slot 2).
    slots = jnp.array([[0, 2], [1, -1], [3, -1]])
    replicas = jnp.array([2, 1, 1])
    counts = jnp.array([[3, 2, 0], [3, 2, 0]])
    idx0 = jnp.array([[0, 1], [0, 1], [0, 3]])  # (3 = the sentinel)
    idx1 = jnp.array([[1, 0], [1, 0], [0, 3]])
    np.testing.assert_array_equal(DYNAMIC(idx0, counts, 0, slots, replicas, 4), [[0, 1], [2, 1], [2, 4]])
    np.testing.assert_array_equal(DYNAMIC(idx1, counts, 1, slots, replicas, 4), [[1, 2], [1, 2], [2, 4]])


@pytest.fixture(scope="module")
def skewed_model():
    """The tiny model with a rigged router bias: layer 0 sends most choices to experts 3 and 6, layer 1 to 1 and 4
    (SKEW's hot experts, which the placement below replicates)."""
    with jax.default_matmul_precision("highest"):
        cfg, model = load_model("tiny", "float32", seed=7)
    bias = np.zeros((cfg.num_moe_layers, E), np.float32)
    bias[0, [3, 6]] = 2.0
    bias[1, [1, 4]] = 2.0
    model.moe_layers.ffn.router_bias_E.set_value(jnp.asarray(bias))
    return cfg, model


def run_steps(runner: StepRunner, cfg, between=None):
    """A prompt step then a decode step on every rank: their logits and the rows each device's experts received."""
    runner.reset_cache()
    dp = runner.layout.dp
    pieces = [[Piece([(r * 11 + s * 5 + j * 3 + 1) % cfg.vocab_size for j in range(3 + 2 * s)], 0,
                     [s * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)]) for s in range(2)] for r in range(dp)]
    decode = [[Piece([(r + s + 2) % cfg.vocab_size], 3 + 2 * s, p.pages) for s, p in enumerate(ps)]
              for r, ps in enumerate(pieces)]
    logits, rows = [], []
    for absorbed, rank_pieces in ((False, pieces), (True, decode)):
        n = B if absorbed else T
        batches = [build_rank_batch(p, num_rows=n, num_seqs=B, pages_per_seq=PAGES_PER_SEQ, page_size=PAGE,
                                    num_pages=NPAGES) for p in rank_pieces]
        out, rows_WE = runner.run(StepShape(absorbed, n, B, PAGES_PER_SEQ), stack_ranks(batches))
        logits.append(np.asarray(out)[:, :2])
        rows.append(np.asarray(rows_WE).reshape(runner.layout.world, -1).sum(1))
        if between is not None:
            between()
    return logits, rows


@pytest.mark.parametrize("spec", ["dp=8,moe=ep", pytest.param("dp=4,tp=2,moe=ep", marks=pytest.mark.slow)])
def test_dynamic_dispatch_gives_static_logits_and_evens_the_devices_in_the_step(spec, skewed_model):
    cfg, model = skewed_model
    lay = parse_mesh_spec(spec)
    mesh = lay.make_mesh(jax.devices()[: lay.world])
    placement = ExpertPlacement.from_load(SKEW, R, W)
    slots, replicas = map_arrays(placement)
    out = {}
    with jax.default_matmul_precision("highest"):
        for dispatch in ("static", "dynamic"):
            runner = StepRunner(with_expert_slots(shard_model(model, lay, mesh), placement, lay, mesh, dispatch),
                                lay, mesh, num_pages=NPAGES, page_size=PAGE)
            out[dispatch] = run_steps(runner, cfg)
        # a new map (each expert's replicas in the other order) between the steps: nothing compiles
        reordered = slots.copy()
        for layer, expert in np.ndindex(*replicas.shape):
            reordered[layer, expert, : replicas[layer, expert]] = slots[layer, expert, : replicas[layer, expert]][::-1]
        again = run_steps(runner, cfg, between=lambda: runner.set_expert_map(reordered, replicas))
    assert runner.compiles == 2
    for got in (out["dynamic"][0], again[0]):
        for a, b in zip(got, out["static"][0], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=spec)
    for dynamic, static in zip(out["dynamic"][1], out["static"][1], strict=True):
        assert dynamic.sum() == static.sum()  # the same pairs, only their replicas differ
        assert dynamic.max() <= static.max(), (dynamic, static)
    assert out["dynamic"][1][0].max() < out["static"][1][0].max()  # the prompt step: strictly more even here


def test_dispatch_flags_refused_in_one_sentence():
    check_dispatch_flags("static", 0, None)
    check_dispatch_flags("dynamic", 8, None)
    with pytest.raises(RecorderError) as e:
        check_dispatch_flags("dynamic", 0, None)
    assert str(e.value) == ("--ep-dispatch-algorithm dynamic chooses among an expert's replicas; give "
                            "--ep-num-redundant-experts at least 1 (moe=ep).")
    with pytest.raises(UserError) as e:  # the server: before anything loads
        serve_config(build_parser().parse_args(["--mesh", "dp=8,moe=ep", "--ep-dispatch-algorithm", "dynamic"]))
    assert str(e.value).startswith("--ep-dispatch-algorithm dynamic chooses among") and "\n" not in str(e.value)
    placement = ExpertPlacement.from_load(SKEW, R, W)
    with pytest.raises(PlacementError, match=r"^--ep-dispatch-algorithm 'random' is not built; use static or "
                                             r"dynamic\.$"):
        with_expert_slots(None, placement, parse_mesh_spec("dp=8,moe=ep"), None, "random")


def test_the_dispatch_table_runs_and_dynamic_is_at_least_as_even():
    """`python -m jaxdp.eplb.dispatch` (docs/eplb.md's table) on one small case: dynamic never less balanced."""
    row = dispatch.run_case(dispatch.DispatchCase(8, 2, 8, 8, 16, False), steps=2, seed=3)
    assert row["dynamic_worst"] >= row["static_worst"] and row["dynamic_mean"] >= row["static_mean"]
    assert dispatch.main(["--steps", "0"]) == 2
