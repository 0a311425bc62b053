"""Two-batch overlap: a step split into two micro-batches gives the numbers of the same step run whole.

Each layout runs a prompt step (several prompts per rank, split at a sequence boundary) and then a decode step
(the sequences split in halves), once whole and once split, from the same cache; the split's greedy tokens equal
the whole step's and its logits are close (today's layout tolerance), and so are the caches it leaves. Plus the
host's split rules (SGLang's balanced boundary and threshold) on hand-worked cases.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.engine.step.buckets import Buckets
from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import load_model
from jaxdp.parallel.agreement import Proposal, agree_on_step
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.parallel.tbo_split import check_threshold, micro_rows, split_bits, split_row
from jaxdp.serve import build_parser
from jaxdp.serve_config import UserError, tbo_threshold

PAGE, NPAGES, PAGES_PER_SEQ = 8, 64, 4
T_EXT, B = 32, 8
THRESHOLD = 0.48


@pytest.fixture(scope="module")
def model():
    with jax.default_matmul_precision("highest"):
        yield load_model("tiny", "float32", seed=7)


def _prompts(dp: int, vocab: int):
    """Per rank: prompts of lengths that balance within the threshold (3 + 4 + 5 + 4 = 16 rows: 7 | 9 ...)."""
    lengths = [[3, 4, 5, 4], [6, 6], [2, 3, 3, 2, 4], [5, 5, 5]]
    out = []
    for r in range(dp):
        ls = lengths[r % len(lengths)]
        out.append([[(r * 31 + k * 7 + j * 3 + 1) % vocab for j in range(n)] for k, n in enumerate(ls)])
    return out


def _run(runner: StepRunner, micro: bool):
    """A prompt step then a decode step; returns (prompt logits, decode logits, cache) as numpy."""
    runner.reset_cache()
    dp, cfg = runner.layout.dp, runner.cfg
    prompts = _prompts(dp, cfg.vocab_size)
    pages = [[list(range(k * PAGES_PER_SEQ, (k + 1) * PAGES_PER_SEQ)) for k in range(len(p))] for p in prompts]
    out = []
    for absorbed in (False, True):
        T = B if absorbed else T_EXT
        m = micro_rows(T, THRESHOLD, absorbed, runner.layout.tp) if micro else 0
        shape = StepShape(absorbed, T, B, PAGES_PER_SEQ, micro_rows=m)
        if absorbed:
            pieces = [[Piece([(r + k * 5 + 2) % cfg.vocab_size], len(t), pages[r][k]) for k, t in enumerate(p)]
                      for r, p in enumerate(prompts)]
        else:
            pieces = [[Piece(t, 0, pages[r][k]) for k, t in enumerate(p)] for r, p in enumerate(prompts)]
        batches = [build_rank_batch(p, num_rows=T, num_seqs=B, pages_per_seq=PAGES_PER_SEQ, page_size=PAGE,
                                    num_pages=NPAGES) for p in pieces]
        logits, _ = runner.run(shape, stack_ranks(batches))
        out.append(np.asarray(logits))
    return out[0], out[1], {k: np.asarray(v) for k, v in runner.cache.items()}


_SLOW = pytest.mark.slow  # (about 55 s each on 2 cores; the default suite keeps dp=8 EP, the overlap's target)


@pytest.mark.parametrize("spec", [pytest.param("dp=8", marks=_SLOW), "dp=8,moe=ep",
                                  pytest.param("dp=4,tp=2,moe=ep", marks=_SLOW)])
def test_split_step_equals_whole_step(spec, model):
    """Slow variants: dp=8 (the gathered MoE, MAX_LEN per micro-batch) and dp=4,tp=2 EP (attention's reduce-scatter
    inside the group per micro-batch) give the whole step's numbers too."""
    cfg, m = model
    lay = parse_mesh_spec(spec)
    with jax.default_matmul_precision("highest"):
        runner = StepRunner(m, lay, lay.make_mesh(jax.devices()[: lay.world]), num_pages=NPAGES, page_size=PAGE)
        whole = _run(runner, micro=False)
        split = _run(runner, micro=True)
    prompts = _prompts(lay.dp, cfg.vocab_size)
    for kind, w, s in (("prompt", whole[0], split[0]), ("decode", whole[1], split[1])):
        for r in range(lay.dp):
            n = len(prompts[r])  # the real sequences (the rest are padding)
            np.testing.assert_allclose(s[r, :n], w[r, :n], atol=1e-4, rtol=0, err_msg=f"{spec} {kind} rank {r}")
            assert (s[r, :n].argmax(-1) == w[r, :n].argmax(-1)).all(), (spec, kind, r)
    for k in whole[2]:
        np.testing.assert_allclose(split[2][k], whole[2][k], atol=1e-4, rtol=0, err_msg=f"{spec} cache {k}")


def test_split_rules_follow_sglang():
    valid = np.ones(10, bool)
    # decode: the first half of the sequences
    assert split_row(np.arange(10), valid, True, THRESHOLD, 5) == 5
    assert split_row(np.arange(7), np.ones(7, bool), True, THRESHOLD, 4) == 3
    # a prompt step: the boundary closest to half the tokens (lengths 3, 4, 3 -> after 3 or 7 of 10: tie, later)
    seq = np.array([0] * 3 + [1] * 4 + [2] * 3)
    assert split_row(seq, valid, False, 0.3, 7) == 7
    # lengths 6, 4: 0.4 < 0.48, refused (SGLang would split inside the first sequence)
    seq = np.array([0] * 6 + [1] * 4)
    assert split_row(seq, valid, False, THRESHOLD, 6) is None
    assert split_row(seq, valid, False, 0.4, 6) == 6
    # one sequence: no boundary; an idle rank: always
    assert split_row(np.zeros(10, int), valid, False, THRESHOLD, 6) is None
    assert split_row(np.zeros(4, int), np.zeros(4, bool), False, THRESHOLD, 2) == 0
    # a side past the compiled micro-batch is refused
    assert split_row(np.array([0] * 5 + [1] * 5), valid, False, THRESHOLD, 4) is None
    assert micro_rows(32, THRESHOLD, False) == 17 and micro_rows(32, THRESHOLD, False, tp=2) == 18
    assert micro_rows(8, THRESHOLD, True) == 4
    with pytest.raises(ValueError, match="must be in"):
        check_threshold(0.7)


def test_ranks_split_only_when_every_busy_rank_can():
    can, cannot, idle = Proposal(8, True, False, tbo=2), Proposal(8, True, False, tbo=1), Proposal(0, False, False)
    assert agree_on_step([can, can, idle]).tbo  # an idle rank never holds the split back
    assert not agree_on_step([can, cannot, idle]).tbo  # (its batch splits only as a decode step)
    assert not agree_on_step([idle, idle]).tbo  # no step at all
    dec, odd = Proposal(3, False, True, tbo=1), Proposal(3, False, True, tbo=1)
    assert agree_on_step([dec, odd]).tbo and not agree_on_step([dec, Proposal(3, False, True)]).tbo
    # what a rank proposes: three decoders split as a decode step (1 | 2), not as one-token extends (1/3 < 0.48)
    assert split_bits([1, 1, 1], THRESHOLD) == 1 and split_bits([1, 1, 1, 1], THRESHOLD) == 3
    assert split_bits([5, 4, 1], THRESHOLD) == 2 and split_bits([6, 4], THRESHOLD) == 0


def test_buckets_compile_every_split_shape_and_choose_it_when_agreed():
    plain = Buckets.make(8, 64, 4, decode=[1, 8], extend=[16, 64], max_len_rows=16).with_pages(4, 8)
    tbo = dataclasses.replace(plain, tbo_threshold=THRESHOLD, tp=2)
    extra = set(tbo.shapes()) - set(plain.shapes())
    assert {(s.kind, s.num_rows, s.micro_rows, s.gather_mode) for s in extra} == {
        ("decode", 8, 4, "max_len"), ("extend", 16, 10, "max_len"), ("extend", 64, 34, "max_len")}
    both = agree_on_step([Proposal(40, True, False, pages=2, tbo=2)] * 4)
    one = agree_on_step([Proposal(40, True, False, pages=2, tbo=2), Proposal(40, True, False, pages=2)] * 2)
    assert tbo.shape_for([40] * 4, both).micro_rows == 34 and tbo.shape_for([40] * 4, both) in extra
    assert tbo.shape_for([40] * 4, one).micro_rows == 0 and plain.shape_for([40] * 4, both).micro_rows == 0


def test_server_flags():
    parse = build_parser().parse_args
    assert tbo_threshold(parse([])) is None  # off by default
    assert tbo_threshold(parse(["--enable-two-batch-overlap"])) == 0.48  # SGLang's default
    assert tbo_threshold(parse(["--enable-two-batch-overlap", "--tbo-token-distribution-threshold", "0.3"])) == 0.3
    with pytest.raises(UserError, match="must be in"):
        tbo_threshold(parse(["--enable-two-batch-overlap", "--tbo-token-distribution-threshold", "0.7"]))
