"""The expert-distribution recorder (issue 47 point 2): the routed tokens per MoE layer and logical expert that the
compiled step counts on the devices, against the router's choices counted on the host.

The host's count: the same rows run through the model on one device (no cache: each sequence alone, as the prompt
step sees it), with a comm that hands back the router's top-k ids of every MoE layer; numpy counts the ids of the
valid rows. The step's count: a recording over two prompt steps under a layout, through the runner's recorder.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.eplb.distribution import RecorderError, check_recorder_mode
from jaxdp.eplb.placement import ExpertPlacement
from jaxdp.eplb.recorder import ExpertRecorder
from jaxdp.eplb.slots import with_expert_slots
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import load_model
from jaxdp.model.mla import AttnBatch
from jaxdp.model.sharded import shard_model
from jaxdp.parallel.local import LocalComm
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.parallel.totals import compiled_gather, read_whole

PAGE, NPAGES, PAGES_PER_SEQ, T, B, SUM_ROWS = 8, 16, 2, 16, 4, 64


@pytest.fixture(scope="module")
def model():
    with jax.default_matmul_precision("highest"):
        yield load_model("tiny", "float32", seed=7)


class RouterIds(LocalComm):
    """One device, and `moe` hands back the router's ids [T, K] (stacked per layer by `rows_by_layer`)."""

    def moe(self, h_TD, valid_T, moe):
        idx_TK, w_TK = moe.route(h_TD, valid_T)
        y_TD, _ = moe.experts(h_TD, idx_TK, w_TK)
        return y_TD + moe.shared_expert(h_TD).astype(jnp.float32), idx_TK


def rank_pieces(cfg, dp: int, step: int) -> list[list[Piece]]:
    """Fresh prompts on every rank, of uneven lengths (a rank with one row, one with a full bucket)."""
    out = []
    for r in range(dp):
        lengths = [1 + (r * 3 + step) % 7, 2 + (r + step * 5) % 6] if r % 3 else [T - 1 - step]
        out.append([Piece([(r * 13 + step * 7 + s * 5 + j * 3 + 1) % cfg.vocab_size for j in range(n)], 0,
                          [s * PAGES_PER_SEQ + p for p in range(PAGES_PER_SEQ)]) for s, n in enumerate(lengths)])
    return out


@nnx.jit
def router_ids(m, tokens_T, valid_T, positions_T, seq_T, logits_idx_B):
    """The router's ids of every MoE layer [L, T, K], the rows alone on one device."""
    attn = AttnBatch(positions_T=positions_T, seq_T=seq_T)
    return m(tokens_T, valid_T, attn, None, logits_idx_B, RouterIds(), absorbed=False, rows_by_layer=True)[2]


def host_counts(model, batches) -> np.ndarray:
    """[ranks, layers, E]: each rank's rows run alone on one device, the router's ids of its valid rows counted by
    numpy."""
    cfg, m = model
    out = np.zeros((len(batches), cfg.num_moe_layers, cfg.n_routed_experts), np.int64)
    for r, b in enumerate(batches):
        valid = np.asarray(b.valid_T, bool)
        ids_LTK = np.asarray(router_ids(m, b.tokens_T, valid, b.positions_T, b.seq_T, b.logits_idx_B))
        for layer in range(cfg.num_moe_layers):
            np.add.at(out[r, layer], ids_LTK[layer][valid].reshape(-1), 1)
    return out


@pytest.mark.parametrize("spec, gather_mode, redundant", [
    ("dp=8,moe=ep", "max_len", 8),  # physical slots with a skewed map: the count is of logical experts
    ("dp=4,tp=2", "sum_len", 0),  # the gathered MoE: each device counts its own chunk of its rank's rows
    pytest.param("dp=2,tp=4,moe=ep", "max_len", 0, marks=pytest.mark.slow),  # (tp chunks under EP; 7 s)
])
def test_recorded_counts_equal_the_routers_choices_counted_on_the_host(spec, gather_mode, redundant, model):
    cfg, m = model
    lay = parse_mesh_spec(spec)
    mesh = lay.make_mesh(jax.devices()[: lay.world])
    with jax.default_matmul_precision("highest"):
        sharded = shard_model(m, lay, mesh)
        if redundant:
            load = np.array([[5, 1, 2, 90, 7, 1, 30, 3], [1, 60, 2, 2, 40, 9, 1, 1]], np.int64)[: cfg.num_moe_layers]
            sharded = with_expert_slots(sharded, ExpertPlacement.from_load(load, redundant, lay.world), lay, mesh)
        runner = StepRunner(sharded, lay, mesh, num_pages=NPAGES, page_size=PAGE)
        shape = StepShape(False, T, B, PAGES_PER_SEQ, gather_mode, SUM_ROWS if gather_mode == "sum_len" else 0)
        want = np.zeros((lay.dp, cfg.num_moe_layers, cfg.n_routed_experts), np.int64)
        runner.run(shape, stack_ranks(rank_batches(cfg, lay.dp, 9)))  # before the recording: not counted
        assert runner.experts.dump() is None
        runner.experts.start()
        for step in range(2):
            batches = rank_batches(cfg, lay.dp, step)
            runner.reset_cache()
            runner.run(shape, stack_ranks(batches))
            want += host_counts(model, batches)
        runner.experts.stop()
        runner.run(shape, stack_ranks(rank_batches(cfg, lay.dp, 3)))  # after it: not counted
    got = runner.experts.dump()
    assert got.steps == 2 and got.per_device.shape == (lay.world, cfg.num_moe_layers, cfg.n_routed_experts)
    np.testing.assert_array_equal(got.per_rank(lay.tp), want, err_msg=spec)
    np.testing.assert_array_equal(got.logical_count, want.sum(0))
    rows = sum(b.num_rows for step in range(2) for b in rank_batches(cfg, lay.dp, step))
    assert got.logical_count.sum() == rows * cfg.num_experts_per_tok * cfg.num_moe_layers
    assert runner.compiles == 1  # recording on or off is the same program
    runner.experts.start()  # a new recording starts from zero
    assert runner.experts.dump() is None


def rank_batches(cfg, dp: int, step: int):
    return [build_rank_batch(p, num_rows=T, num_seqs=B, pages_per_seq=PAGES_PER_SEQ, page_size=PAGE,
                             num_pages=NPAGES) for p in rank_pieces(cfg, dp, step)]


def test_recorder_mode_and_empty_recorder():
    check_recorder_mode(None)
    check_recorder_mode("stat")
    with pytest.raises(RecorderError, match=r"^--expert-distribution-recorder-mode 'per_token' is not built; use "
                                            r"stat \(or leave it out\)\.$"):
        check_recorder_mode("per_token")
    assert ExpertRecorder().add(jnp.ones((2, 1, 4), jnp.int32)) is None  # no MoE layers: nothing to record
    rec = ExpertRecorder(jax.ShapeDtypeStruct((2, 1, 4), jnp.int32))
    rec.add(jnp.ones((2, 1, 4), jnp.int32))  # not recording: ignored
    assert rec.dump() is None
    rec.start()
    rec.add(jnp.ones((2, 1, 4), jnp.int32))
    rec.add(jnp.full((2, 1, 4), 2, jnp.int32))
    dump = rec.dump()
    assert dump.steps == 2 and dump.logical_count.tolist() == [[6, 6, 6, 6]]
    assert dump.to_json()["logical_count"] == [[6, 6, 6, 6]]


def test_the_gather_a_dump_across_nodes_reads_is_every_devices_counts():
    """`compiled_gather` (the dump's read on a model spanning several nodes): the split counts whole on every device,
    unchanged, read by `read_whole` (here one process: the cluster test in tests/test_eplb_nodes.py runs two)."""
    mesh = jax.make_mesh((8,), ("dp",))
    split = jax.ShapeDtypeStruct((8, 3, 5), jnp.int32, sharding=NamedSharding(mesh, P("dp")))
    counts = np.arange(8 * 3 * 5, dtype=np.int32).reshape(8, 3, 5) * 7 % 11
    whole = compiled_gather(split)(jax.device_put(counts, split.sharding))
    assert whole.is_fully_replicated and len(whole.sharding.device_set) == 8
    np.testing.assert_array_equal(read_whole(whole), counts)
