"""Redundant experts in the EP step (issue 47 point 1): the experts held as E + R physical slots built from a
placement, the logical-to-physical map as an input of the compiled step.

Under every EP layout the tests use, the model with R redundant experts and a non-trivial map gives the logits the
model without redundancy gives (within the layouts' tolerance, tests/test_layouts.py); a new map between two steps
changes no logit and compiles nothing; bad flags and maps are refused in one sentence.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.engine.options import ModelOptions
from jaxdp.engine.setup import build_runners
from jaxdp.eplb.algorithm import PlacementError
from jaxdp.eplb.placement import ExpertPlacement
from jaxdp.eplb.slots import initial_placement, map_arrays, with_expert_slots
from jaxdp.layout import LayoutError, check_redundant_experts, parse_mesh_spec
from jaxdp.model.loader import load_model
from jaxdp.model.sharded import shard_model
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.serve import build_parser, serve_config

PAGE, NPAGES, PAGES_PER_SEQ, T, B = 8, 16, 2, 16, 4
EP_LAYOUTS = ["dp=8,moe=ep", "dp=4,tp=2,moe=ep", "tp=8,moe=ep"]
R = 8  # 8 experts + 8 redundant = 2 slots on each of 8 devices


@pytest.fixture(scope="module")
def model():
    with jax.default_matmul_precision("highest"):
        yield load_model("tiny", "float32", seed=7)


def skewed_placement(cfg, devices: int) -> ExpertPlacement:
    """The algorithm's placement of a skewed load: expert 3 hottest, several experts with 2+ replicas."""
    load = np.array([[5, 1, 2, 90, 7, 1, 30, 3], [1, 60, 2, 2, 40, 9, 1, 1]], np.int64)[: cfg.num_moe_layers]
    placement = ExpertPlacement.from_load(load, R, devices)
    assert placement.replica_counts.max() >= 3 and not np.array_equal(
        placement.physical_to_logical, ExpertPlacement.identity(cfg.num_moe_layers, 8, devices, R).physical_to_logical)
    return placement


def run_two_steps(runner: StepRunner, cfg, between=None) -> list[np.ndarray]:
    """A prompt step on every rank, then a decode step: the logits of both ([dp, B, V] each). `between` runs
    between the two steps (a new map)."""
    dp = runner.layout.dp
    runner.reset_cache()
    pieces, out = [], []
    for r in range(dp):
        pieces.append([Piece([(r * 11 + s * 5 + j * 3 + 1) % cfg.vocab_size for j in range(3 + s)], 0,
                             [s * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)]) for s in range(2)])
    decode = [[Piece([(r + s + 2) % cfg.vocab_size], 3 + s, p.pages) for s, p in enumerate(ps)]
              for r, ps in enumerate(pieces)]
    for absorbed, rank_pieces in ((False, pieces), (True, decode)):
        rows = B if absorbed else T
        shape = StepShape(absorbed, rows, B, PAGES_PER_SEQ)
        batches = [build_rank_batch(p, num_rows=rows, num_seqs=B, pages_per_seq=PAGES_PER_SEQ, page_size=PAGE,
                                    num_pages=NPAGES) for p in rank_pieces]
        logits, _ = runner.run(shape, stack_ranks(batches))
        out.append(np.asarray(logits)[:, :2])
        if between is not None and not absorbed:
            between()
    return out


def runner_for(spec: str, model, placement: ExpertPlacement | None) -> StepRunner:
    cfg, m = model
    lay = parse_mesh_spec(spec)
    mesh = lay.make_mesh(jax.devices()[: lay.world])
    sharded = shard_model(m, lay, mesh)
    if placement is not None:
        sharded = with_expert_slots(sharded, placement, lay, mesh)
    return StepRunner(sharded, lay, mesh, num_pages=NPAGES, page_size=PAGE)


@pytest.mark.parametrize("spec", EP_LAYOUTS)
def test_redundant_experts_give_the_logits_without_redundancy(spec, model):
    cfg, _ = model
    with jax.default_matmul_precision("highest"):
        plain = run_two_steps(runner_for(spec, model, None), cfg)
        runner = runner_for(spec, model, skewed_placement(cfg, 8))
        slots, replicas = runner.expert_map()
        assert slots.shape == (cfg.num_moe_layers, 8, R + 1) and replicas.sum() == cfg.num_moe_layers * (8 + R)
        redundant = run_two_steps(runner, cfg)
    for a, b in zip(redundant, plain, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=spec)


@pytest.mark.parametrize("spec", EP_LAYOUTS)
def test_a_new_map_between_steps_changes_no_logit_and_compiles_nothing(spec, model):
    cfg, _ = model
    placement = skewed_placement(cfg, 8)
    slots, replicas = map_arrays(placement)
    # the same slots, each expert's replicas visited in the other order: other rows go to other devices
    reordered = slots.copy()
    for layer, expert in np.ndindex(*replicas.shape):
        n = replicas[layer, expert]
        reordered[layer, expert, :n] = slots[layer, expert, :n][::-1]
    assert not np.array_equal(reordered, slots)
    with jax.default_matmul_precision("highest"):
        runner = runner_for(spec, model, placement)
        before = run_two_steps(runner, cfg)
        compiles = runner.compiles
        after = run_two_steps(runner, cfg, between=lambda: runner.set_expert_map(reordered, replicas))
    assert runner.compiles == compiles == 2  # the extend and the decode step, compiled once each
    np.testing.assert_array_equal(runner.expert_map()[0], reordered)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0, err_msg=spec)
    # one replica an expert (the first) is a map the held slots serve too
    runner.set_expert_map(reordered, np.ones_like(replicas))
    np.testing.assert_allclose(run_two_steps(runner, cfg)[1], before[1], atol=1e-4, rtol=0)
    assert runner.compiles == compiles


def one_sentence(message: str) -> None:
    assert message.count(". ") == 0 and message.endswith("."), message


@pytest.mark.parametrize("spec, num_redundant, words", [
    ("dp=8", 8, "needs expert parallelism"),
    ("dp=8,moe=ep", 4, "do not split over 8 devices"),
    ("dp=8,moe=ep", -1, "is not a count"),
])
def test_bad_redundant_expert_flags_are_refused_in_one_sentence(spec, num_redundant, words):
    with pytest.raises(LayoutError) as e:
        check_redundant_experts(parse_mesh_spec(spec), 8, num_redundant)
    assert words in str(e.value)
    one_sentence(str(e.value))


def test_bad_maps_are_refused_in_one_sentence(model):
    cfg, _ = model
    placement = skewed_placement(cfg, 8)
    slots, replicas = map_arrays(placement)
    runner = runner_for("dp=8,moe=ep", model, placement)
    wrong_holder = slots.copy()
    expert = int(np.argmax(replicas[0] == 1))
    wrong_holder[0, expert, 0] = slots[0, (expert + 1) % 8, 0]
    for bad_slots, bad_replicas, words in [
        (slots[:, :, :-1], replicas, "an expert map must be"),
        (slots[0], replicas, "an expert map must be"),
        (slots, np.zeros_like(replicas), "1 to"),
        (wrong_holder, replicas, "which holds expert"),
    ]:
        with pytest.raises(PlacementError) as e:
            runner.set_expert_map(bad_slots, bad_replicas)
        one_sentence(str(e.value))
        assert words in str(e.value)
    plain = runner_for("dp=8,moe=ep", model, None)
    with pytest.raises(PlacementError, match="--ep-num-redundant-experts"):
        plain.set_expert_map(slots, replicas)
    # a placement built for another device count or model
    with pytest.raises(PlacementError, match="devices"):
        with_expert_slots(shard_model(model[1], parse_mesh_spec("dp=4,moe=ep"),
                                      parse_mesh_spec("dp=4,moe=ep").make_mesh(jax.devices()[:4])),
                          placement, parse_mesh_spec("dp=4,moe=ep"), parse_mesh_spec("dp=4,moe=ep").make_mesh(
                              jax.devices()[:4]))


def test_initial_placement_is_the_algorithms_on_a_uniform_load(model, tmp_path):
    cfg, _ = model
    lay = parse_mesh_spec("dp=8,moe=ep")
    default = initial_placement(cfg, lay, R)
    assert default.num_physical == 16 and (default.replica_counts == 2).all()
    path = tmp_path / "map.json"
    skewed = skewed_placement(cfg, 8)
    skewed.save(path)
    loaded = initial_placement(cfg, lay, R, str(path))
    np.testing.assert_array_equal(loaded.physical_to_logical, skewed.physical_to_logical)
    with pytest.raises(LayoutError):
        initial_placement(cfg, parse_mesh_spec("dp=8"), R)
    assert dataclasses.is_dataclass(loaded)


@pytest.mark.parametrize("argv, words", [
    (("--mesh", "dp=8", "--ep-num-redundant-experts", "8"), "needs expert parallelism"),
    (("--mesh", "dp=8,moe=ep", "--ep-num-redundant-experts", "-2"), "is not a count"),
    (("--mesh", "dp=8", "--init-expert-location", "map.json"), "under expert parallelism"),
    (("--mesh", "dp=8,moe=ep", "--init-expert-location", "no/such/map.json"), "is not a file"),
])
def test_the_servers_flags_are_checked_before_anything_loads(argv, words):
    with pytest.raises(LayoutError) as e:
        serve_config(build_parser().parse_args(list(argv)))
    assert words in str(e.value)
    one_sentence(str(e.value))


def test_the_servers_flags_land_in_the_model_options(tmp_path):
    path = tmp_path / "map.json"
    ExpertPlacement.identity(2, 8, 8, R).save(path)
    argv = ["--mesh", "dp=8,moe=ep", "--ep-num-redundant-experts", "8", "--init-expert-location", str(path)]
    model = serve_config(build_parser().parse_args(argv)).model
    assert (model.ep_num_redundant_experts, model.init_expert_location) == (R, str(path))
    assert model.ep_dispatch_algorithm == "static"
    dynamic = serve_config(build_parser().parse_args([*argv, "--ep-dispatch-algorithm", "dynamic"])).model
    assert dynamic.ep_dispatch_algorithm == "dynamic"


def test_the_engine_builds_the_slots_from_the_flags(model):
    """The one place the engine feeds the map: `build_runners` with the options the flags give."""
    lay = parse_mesh_spec("dp=8,moe=ep")
    options = ModelOptions("tiny", "float32", seed=7, ep_num_redundant_experts=R, ep_dispatch_algorithm="dynamic")
    runner = build_runners(options, lay, [lay.make_mesh(jax.devices()[:8])], num_pages=NPAGES, page_size=PAGE)[0]
    assert nnx.merge(runner.graphdef, runner.state).moe_layers.ffn.dispatch_algorithm == "dynamic"
    slots, replicas = runner.expert_map()
    assert slots.shape == (runner.cfg.num_moe_layers, 8, R + 1) and (replicas == 2).all()
    cfg, _ = model
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(run_two_steps(runner, cfg)[1], run_two_steps(runner_for("dp=8,moe=ep", model, None),
                                                                                cfg)[1], atol=1e-4, rtol=0)
