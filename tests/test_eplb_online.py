"""Online EPLB (issue 47 point 4): a new placement from the recorded tokens, the expert weights moved between steps
one chunk of layers at a time, with their scales; logits and greedy tokens unchanged; nothing compiled while serving.

Independent checks: every slot's moved parameters equal the logical expert's own parameters (from the model before
it was given slots) that the new map says the slot holds, exactly, for dense and NVFP4 experts; the logits before,
half-way through and after a move agree within the layouts' tolerance (1e-4, tests/test_layouts.py); an engine
serving concurrent requests through rebalances gives the greedy tokens it gives without them.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.config import get_config
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.step.step_stats import compiles_total
from jaxdp.eplb.algorithm import PlacementError
from jaxdp.eplb.distribution import EplbConfig, RecorderError, eplb_config
from jaxdp.eplb.online import Rebalancer, source_slots
from jaxdp.eplb.placement import ExpertPlacement
from jaxdp.eplb.slots import held_physical_to_logical, map_arrays, with_expert_slots
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.layers import axes_of
from jaxdp.model.loader import load_model
from jaxdp.model.quant import quantize_experts
from jaxdp.model.sharded import init_sharded, param_table, shard_model
from jaxdp.parallel.step import StepRunner, StepShape

PAGE, NPAGES, PAGES_PER_SEQ, T, B, R = 8, 16, 2, 16, 4, 8
SPEC = "dp=8,moe=ep"
FP8_SPEC = "dp=8,moe=ep,dense=replicated"  # SGLang's --moe-dense-tp-size 1
SKEW = np.array([[5, 1, 2, 90, 7, 1, 30, 3], [1, 60, 2, 2, 40, 9, 1, 1]], np.int64)
OTHER = np.array([[80, 3, 1, 1, 2, 50, 1, 9], [2, 2, 70, 1, 1, 1, 1, 45]], np.int64)


def logical_experts(model) -> dict[str, np.ndarray]:
    """The MoE stack's parameters with the "experts" axis, as the logical experts hold them [L, E, ...]."""
    moe = model.moe_layers.ffn
    return {n: np.asarray(v.get_value()) for n, v in vars(moe).items()
            if isinstance(v, nnx.Variable) and "experts" in (axes_of(v) or ())}


def steps(runner: StepRunner, cfg) -> list[np.ndarray]:
    """A prompt step then a decode step on every rank: their logits."""
    runner.reset_cache()
    pieces = [[Piece([(r * 11 + s * 5 + j * 3 + 1) % cfg.vocab_size for j in range(3 + s)], 0,
                     [s * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)]) for s in range(2)] for r in range(8)]
    decode = [[Piece([(r + s + 2) % cfg.vocab_size], 3 + s, p.pages) for s, p in enumerate(ps)]
              for r, ps in enumerate(pieces)]
    out = []
    for absorbed, rank_pieces in ((False, pieces), (True, decode)):
        rows = B if absorbed else T
        batches = [build_rank_batch(p, num_rows=rows, num_seqs=B, pages_per_seq=PAGES_PER_SEQ, page_size=PAGE,
                                    num_pages=NPAGES) for p in rank_pieces]
        logits, _ = runner.run(StepShape(absorbed, rows, B, PAGES_PER_SEQ), stack_ranks(batches))
        out.append(np.asarray(logits)[:, :2])
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("quantization", "spec"), [(None, SPEC), ("nvfp4", SPEC), ("fp8", FP8_SPEC)])
def test_a_move_gives_every_slot_its_new_expert_with_its_scales_and_changes_no_logit(quantization, spec):
    """Slow (about 30 s each: two runners' steps compiled): a two-layer move, one layer a chunk, under dp=8,moe=ep
    with 8 redundant experts; shows the weights (and FP8 block scales, NVFP4 scales) follow the map bit for bit and
    no logit moves. Block-FP8 runs with the dense layers whole on every device (FP8_SPEC): the tiny dense FFN's
    128-wide intermediate is one scale block, which 8 devices cannot split (its experts' scales split like their
    values either way; test_block_fp8_experts_scales_split_along_the_experts_axis)."""
    with jax.default_matmul_precision("highest"):
        cfg, model = load_model("tiny", "float32", seed=7, quantization=quantization)
        quantize_experts(model, quantization)
        logical = logical_experts(model)
        lay = parse_mesh_spec(spec)
        mesh = lay.make_mesh(jax.devices()[: lay.world])
        sharded = with_expert_slots(shard_model(model, lay, mesh), ExpertPlacement.from_load(SKEW, R, 8), lay, mesh)
        runner = StepRunner(sharded, lay, mesh, num_pages=NPAGES, page_size=PAGE)
        rebalancer = Rebalancer(runner, EplbConfig(num_iterations=1000, layers_per_chunk=1))
        before = steps(runner, cfg)
        compiles = runner.compiles
        rebalance = rebalancer.start(OTHER)
        assert rebalance.chunks == [(0, 1), (1, 1)] and rebalancer.chunk_sizes == [1]
        assert (rebalance.balancedness_after > rebalance.balancedness_before).all()
        rebalancer.move_next_chunk()  # layer 0 moved, layer 1 not yet: each layer's weights and map agree
        half = steps(runner, cfg)
        rebalancer.move_next_chunk()
        after = steps(runner, cfg)
    assert rebalancer.pending is None and runner.compiles == compiles
    new = rebalance.placement.physical_to_logical
    slots, replicas = runner.expert_map()
    np.testing.assert_array_equal(held_physical_to_logical(slots, replicas, 16), new)
    np.testing.assert_array_equal(slots, map_arrays(rebalance.placement)[0])
    moe = runner.state["moe_layers"]["ffn"]
    dense = {"w_gate_up_ED2I", "w_down_EID"}
    assert set(logical) == {None: dense, "fp8": dense | {f"{n}_bscale" for n in dense},
                            "nvfp4": {"w_gate_up_packed", "w_gate_up_scale", "w_gate_up_gscale", "w_down_packed",
                                      "w_down_scale", "w_down_gscale"}}[quantization]
    for name, w in logical.items():  # every slot holds its new expert's values (and scales), bit for bit
        want = np.stack([w[layer][new[layer]] for layer in range(cfg.num_moe_layers)])
        np.testing.assert_array_equal(np.asarray(moe[name].get_value()), want, err_msg=name)
    for got in (half, after):
        for a, b in zip(got, before, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_source_slots_read_in_place_then_on_the_device_then_anywhere():
    old = np.array([[0, 1, 2, 3, 0, 1]])  # 3 devices of 2 slots
    new = np.array([[0, 3, 1, 2, 2, 0]])
    # slot 0 keeps expert 0; slot 1 wants 3 (slot 3, the only one); slot 2 (device 1) wants 1, held by slots 1 and 5,
    # neither on device 1: the first; slot 3 wants 2 (slot 2, on its device); slot 4 wants 2 (slot 2, the only one);
    # slot 5 (device 2) wants 0, held by slots 0 and 4: slot 4, on its device
    np.testing.assert_array_equal(source_slots(old, new, 2), [[0, 3, 1, 2, 2, 4]])


def test_eplb_flags_refused_in_one_sentence():
    assert eplb_config(False, None, None, "tp", 0) is None
    assert eplb_config(True, None, 2, "ep", 8) == EplbConfig(1000, 2)
    for args, says in (((False, 5, None, "ep", 8), "--eplb-rebalance-num-iterations and --eplb-rebalance-layers-"
                                                   "per-chunk need --enable-eplb."),
                       ((True, None, None, "tp", 8), "--enable-eplb moves experts between the slots of"),
                       ((True, None, None, "ep", 0), "--enable-eplb moves experts between the slots of"),
                       ((True, 0, None, "ep", 8), "--eplb-rebalance-num-iterations must be at least 1, not 0.")):
        with pytest.raises(RecorderError) as e:
            eplb_config(*args)
        assert str(e.value).startswith(says) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_rebalance_while_requests_run_changes_no_greedy_token_and_leaves_everything_accounted():
    """Slow (about 25 s: an engine's steps compiled). 64 concurrent requests through an engine whose rebalancer
    decides a placement every 3 steps and moves one layer a step: the greedy tokens of a run without rebalancing,
    nothing compiled, every page back in its pool, every slot one expert's."""
    cfg = EngineConfig(page_size=4, num_pages=96, max_running_requests=64, chunked_prefill_size=128,
                       decode_buckets=[8], extend_buckets=[16], max_len_extend_rows=16, enable_prefix_cache=False,
                       eplb=EplbConfig(num_iterations=10**9, layers_per_chunk=1))
    with jax.default_matmul_precision("highest"):
        engine = Engine("tiny", SPEC, cfg, seed=0, ep_num_redundant_experts=R, warmup=False)
        try:
            prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(2 + i % 9)] for i in range(64)]
            greedy = SamplingParams(max_new_tokens=6, temperature=0)
            plain = [r.output_ids for r in engine.generate(prompts, greedy)]
            rebalancer = engine.rebalancer
            assert not rebalancer.rebalances
            rebalancer.config = EplbConfig(num_iterations=3, layers_per_chunk=1)
            compiles, first_map = compiles_total(), engine.runner.expert_map()[0]
            moved = [r.output_ids for r in engine.generate(prompts, greedy)]
            assert not np.array_equal(engine.runner.expert_map()[0], first_map)  # the experts did move
            assert compiles_total() == compiles  # the moves were compiled with the engine
            assert len(rebalancer.rebalances) >= 2 and len(rebalancer.move_seconds) >= 3
            assert moved == plain
            for s in engine.schedulers:  # every page back
                assert not s.running and not s.waiting and s.pool.free + s.cache.size == s.pool.num_pages
            slots, replicas = engine.runner.expert_map()
            held = held_physical_to_logical(slots, replicas, 8 + R)
            ExpertPlacement.from_physical_to_logical(held, 8, 8)  # every slot one expert's, every expert placed
            assert replicas.sum() == cfg_layers(engine) * (8 + R)
        finally:
            engine.shutdown()


def cfg_layers(engine) -> int:
    return engine.model_cfg.num_moe_layers


def test_rebalancing_needs_the_slots():
    runner = SimpleNamespace(expert_map=lambda: None)  # (experts held without a map)
    with pytest.raises(PlacementError, match="^--enable-eplb moves experts between the slots of "):
        Rebalancer(runner, EplbConfig())


def test_block_fp8_experts_scales_split_along_the_experts_axis():
    """Under dp=8,moe=ep a block-FP8 expert's scales split over the experts axis as its values do (so a move carries
    them); what does not split is the tiny dense FFN's one 128-wide scale block over 8 devices, refused in one sentence
    before anything is allocated; with dense=replicated the model builds."""
    cfg = get_config("tiny")
    lay = parse_mesh_spec(SPEC)
    table = param_table(cfg, lay, np.float32, "fp8")
    for name in ("w_gate_up_ED2I", "w_down_EID"):
        values, scales = table[f"moe_layers.ffn.{name}"], table[f"moe_layers.ffn.{name}_bscale"]
        assert scales.axes == values.axes and scales.spec == values.spec and values.spec[1] == ("dp", "tp")
        assert scales.shape[:2] == values.shape[:2] == (cfg.num_moe_layers, cfg.n_routed_experts)
    mesh = lay.make_mesh(jax.devices()[: lay.world])
    with pytest.raises(ValueError) as e:
        init_sharded(cfg, lay, mesh, quantization="fp8")
    assert str(e.value).startswith("the FP8 weight dense_layers.ffn.w_down_FD (128 wide along axis 1) does not split "
                                   "into whole 128-wide scale blocks over 8 devices") and "\n" not in str(e.value)
    fp8 = parse_mesh_spec(FP8_SPEC)
    built = init_sharded(cfg, fp8, fp8.make_mesh(jax.devices()[: fp8.world]), quantization="fp8")
    scale = built.state["moe_layers"]["ffn"]["w_down_EID_bscale"].get_value()
    assert scale.sharding.shard_shape(scale.shape)[1] == cfg.n_routed_experts // 8
