"""`jaxdp.bench.profile`'s steps: a decode step's rows, an extend step's prompts and the decoders it carries."""

from jaxdp.bench.profile import step_pieces
from jaxdp.config import get_config
from jaxdp.parallel.step import StepShape


def test_a_mixed_extend_step_holds_its_prompts_then_its_decoders():
    cfg = get_config("tiny")
    pieces = step_pieces(cfg, StepShape(False, 2 * 8 + 3, 8, 4), context=8, decoders=3)
    assert [(len(p.tokens), p.start) for p in pieces] == [(8, 0), (8, 0), (1, 8), (1, 8), (1, 8)]
    assert [p.pages for p in pieces] == [list(range(4 * b, 4 * b + 4)) for b in range(5)]  # pages of their own
    decode = step_pieces(cfg, StepShape(True, 6, 6, 4), context=8)
    assert [(len(p.tokens), p.start) for p in decode] == [(1, 8)] * 6
    assert [(len(p.tokens), p.start) for p in step_pieces(cfg, StepShape(False, 16, 2, 4), 8)] == [(8, 0)] * 2
