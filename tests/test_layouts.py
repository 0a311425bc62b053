"""Every layout gives the single-device numbers, in each of the article's five situations (scaled down),
in MAX_LEN and SUM_LEN; padding rows never reach an expert.

A situation is two steps: a prompt step that creates the decoding requests (3 tokens each), then the
situation's step: a decode step (balanced, single, skewed) or an extend step where rank 0 reads a
prompt while the other ranks' decoding requests are presented as one-token extends (short and long
prompt). Situation ranks are folded onto the layout's dp ranks (rank % dp). The reference runs the same
requests on one device.
"""

import jax
import numpy as np
import pytest

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import load_model
from jaxdp.parallel.step import StepRunner, StepShape

pytestmark = pytest.mark.usefixtures("blocked_prompt_path")  # the form real sizes run (conftest)

RANKS = 8
PAGE, NPAGES, PAGES_PER_SEQ = 8, 64, 4
T_EXT, B, SUM_ROWS = 64, 16, 64

# name -> (decoding requests per situation rank, prompt length on rank 0 or 0)
SITUATIONS = {
    "balanced": ([2] * RANKS, 0),
    "single": ([1] + [0] * (RANKS - 1), 0),
    "skewed": ([5] + [1] * (RANKS - 1), 0),
    "short_prompt": ([0] + [2] * (RANKS - 1), 8),
    "long_prompt": ([0] + [2] * (RANKS - 1), 24),
}
_SLOW = pytest.mark.slow  # CI keeps one layout of each kind; these three vary one that CI runs (12 s each)
LAYOUTS = ["tp=8", "dp=8", pytest.param("dp=2,tp=4", marks=_SLOW), "dp=4,tp=2", "dp=8,moe=ep", "dp=8,lm_head=dp",
           pytest.param("dp=8,dense=replicated", marks=_SLOW), pytest.param("dp=8,lm_head=a2a", marks=_SLOW),
           "dp=4,tp=2,moe=ep"]


@pytest.fixture(scope="module")
def model():
    with jax.default_matmul_precision("highest"):
        yield load_model("tiny", "float32", seed=7)


def run_situation(runner: StepRunner, name: str, gather_mode: str):
    """Returns ({request: logits of the situation step}, expert rows counted, real rows of that step)."""
    counts, prompt_len = SITUATIONS[name]
    dp, cfg = runner.layout.dp, runner.cfg
    runner.reset_cache()
    reqs = []  # (request id, rank, prompt tokens)
    for r, n in enumerate(counts):
        for _ in range(n):
            rid = len(reqs)
            reqs.append((rid, r % dp, [(rid * 7 + j * 3 + 1) % cfg.vocab_size for j in range(3)]))
    next_page = [0] * dp
    pages = {}
    for rid, rank, _ in reqs + [(-1, 0, None)]:
        pages[rid] = list(range(next_page[rank], next_page[rank] + PAGES_PER_SEQ))
        next_page[rank] += PAGES_PER_SEQ

    def step(pieces_by_rank, absorbed):
        T = B if absorbed else T_EXT
        shape = StepShape(absorbed, T, B, PAGES_PER_SEQ, gather_mode, SUM_ROWS if gather_mode == "sum_len" else 0)
        batches = [build_rank_batch(p, num_rows=T, num_seqs=B, pages_per_seq=PAGES_PER_SEQ, page_size=PAGE,
                                    num_pages=NPAGES) for p in pieces_by_rank]
        logits, rows_E = runner.run(shape, stack_ranks(batches))
        return np.asarray(logits), np.asarray(rows_E), sum(b.num_rows for b in batches)

    prefill = [[] for _ in range(dp)]
    order = [[] for _ in range(dp)]
    for rid, rank, toks in reqs:
        prefill[rank].append(Piece(toks, 0, pages[rid]))
        order[rank].append(rid)
    if reqs:
        step(prefill, absorbed=False)
    situation = [[Piece([(rid * 5 + 2) % cfg.vocab_size], 3, pages[rid]) for rid in order[r]] for r in range(dp)]
    if prompt_len:
        prompt = [(11 * j + 5) % cfg.vocab_size for j in range(prompt_len)]
        situation[0].insert(0, Piece(prompt, 0, pages[-1]))
        order[0].insert(0, -1)
    logits, rows_E, real_rows = step(situation, absorbed=not prompt_len)
    out = {rid: logits[r, k] for r in range(dp) for k, rid in enumerate(order[r])}
    return out, rows_E, real_rows


@pytest.fixture(scope="module")
def reference(model):
    cfg, m = model
    lay = parse_mesh_spec("dp=1")
    with jax.default_matmul_precision("highest"):
        runner = StepRunner(m, lay, lay.make_mesh(jax.devices()[:1]), num_pages=NPAGES * RANKS, page_size=PAGE)
        return {name: run_situation(runner, name, "max_len")[0] for name in SITUATIONS}


@pytest.mark.parametrize("spec", LAYOUTS)
def test_layout_matches_single_device_in_all_situations(spec, model, reference):
    cfg, m = model
    lay = parse_mesh_spec(spec)
    with jax.default_matmul_precision("highest"):
        runner = StepRunner(m, lay, lay.make_mesh(jax.devices()[: lay.world]), num_pages=NPAGES, page_size=PAGE)
        for mode in ("max_len", "sum_len"):
            for name in SITUATIONS:
                got, rows_E, real_rows = run_situation(runner, name, mode)
                ref = reference[name]
                assert got.keys() == ref.keys()
                for rid in ref:
                    np.testing.assert_allclose(got[rid], ref[rid], atol=1e-4, rtol=0,
                                               err_msg=f"{spec} {mode} {name} request {rid}")
                # padding rows are never dispatched: the experts receive exactly the real rows' choices
                expected = real_rows * cfg.num_experts_per_tok * cfg.num_moe_layers
                received = rows_E.sum() if lay.moe == "ep" else rows_E[0].sum()
                assert received == expected, (spec, mode, name, received, expected)
    assert runner.compiles == 4  # extend and decode, in each gather mode: situations share compiled steps


def test_tp_groups_fold_the_attention_all_reduce_into_the_gather(model):
    """dp=2,tp=4: reduce-scatter in the group + one all-gather, and no all-reduce anywhere (MAX_LEN)."""
    cfg, m = model
    lay = parse_mesh_spec("dp=2,tp=4")
    runner = StepRunner(m, lay, lay.make_mesh(jax.devices()[:8]), num_pages=8, page_size=PAGE)
    hlo = runner.hlo_text(StepShape(True, 8, 8, 2))
    assert "reduce-scatter" in hlo and "all-gather" in hlo
    assert "all-reduce(" not in hlo and "all-reduce-start" not in hlo


def test_step_reports_its_accounting_and_the_experts_compute_only_needed_rows(model):
    cfg, m = model
    lay = parse_mesh_spec("dp=8")
    with jax.default_matmul_precision("highest"):
        runner = StepRunner(m, lay, lay.make_mesh(jax.devices()[:8]), num_pages=NPAGES, page_size=PAGE)
        _, rows_E, real_rows = run_situation(runner, "skewed", "max_len")
    acc = runner.last_account
    assert acc.rows == (5, 1, 1, 1, 1, 1, 1, 1) and acc.gather_mode == "max_len" and acc.kind == "decode"
    assert acc.gathered_rows == 8 * B  # every rank padded to the shared bucket
    assert acc.experts_jaxdp.computed == acc.experts_jaxdp.needed == real_rows
    assert acc.experts_sglang.computed == 8 * B  # SGLang would push the padding through the experts
    assert rows_E[0].sum() == real_rows * cfg.num_experts_per_tok * cfg.num_moe_layers


def test_pallas_decode_kernel_in_the_model_matches_the_xla_path(model):
    """--attention-backend pallas (interpret mode on the CPU) inside the sharded step, dp=8."""
    from jaxdp.ops.attention import decode_kernels as decode_kernel

    cfg, m = model
    lay = parse_mesh_spec("dp=8")
    outs = []
    with jax.default_matmul_precision("highest"):
        for backend in ("xla", "pallas"):
            runner = StepRunner(m, lay, lay.make_mesh(jax.devices()[:8]), num_pages=NPAGES, page_size=PAGE,
                                decode_kernel=decode_kernel(backend))
            outs.append(run_situation(runner, "skewed", "max_len")[0])
    for rid in outs[0]:
        np.testing.assert_allclose(outs[1][rid], outs[0][rid], atol=1e-4, rtol=0)
