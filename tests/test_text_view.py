"""The streamed text (`jaxdp.api.common.TextView`): decoded incrementally, it equals the rule applied to the
whole output at every token (decode everything, cut before the first stop string, hold back a partial
character and a tail that could begin a stop string), for a byte-level tokenizer (partial UTF-8) and a
SentencePiece-style one (a leading space dropped at the start of a decode)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from jaxdp.api.common import TextView
from jaxdp.engine.sched.request import Request, SamplingParams, State
from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer


def whole_text_rule(tok, ids: list[int], stops: list[str], finished: bool) -> str:
    full = tok.decode(ids, skip_special_tokens=True)
    cuts = [(full.find(s), s) for s in stops if s in full]
    if cuts:
        return full[: min(cuts)[0]]
    if finished:
        return full
    full = full.rstrip("\ufffd")
    hold = max((len(s) for s in stops), default=1) - 1
    return full[: max(0, len(full) - hold)] if stops and hold else full


def metaspace_tokenizer() -> HFTokenizer:
    words = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "lo": 3, "\u2581": 4, "x": 5, "\u2581y": 6}
    tok = HFTokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace()
    return tok


@pytest.mark.parametrize("kind,stops", [("bytes", []), ("bytes", ["ab", "\n\n", "\u00e9t"]),
                                        ("metaspace", []), ("metaspace", ["y x", "world", "lo lo"])])
def test_incremental_text_equals_the_whole_text_rule_at_every_token(kind, stops):
    tok, vocab = (Tokenizer(default_model_path()), 262) if kind == "bytes" else (metaspace_tokenizer(), 7)
    rng = random.Random(0)
    for _ in range(200):
        req, view = Request("r", [1], SamplingParams(stop=stops)), TextView(tok, stops)
        for _ in range(rng.randint(1, 40)):
            # bytes: mostly ASCII letters and the lead/continuation bytes of 2-3 byte characters
            req.output_ids.append(rng.choice([rng.randrange(6, 262), 6 + ord(rng.choice("abt\n")), 6 + 0xC3,
                                              6 + 0xA9]) if kind == "bytes" else rng.randrange(vocab))
            assert view.text(req) == whole_text_rule(tok, req.output_ids, stops, False), req.output_ids
            if view.matched:
                break
        req.state = State.FINISHED
        assert view.text(req) == whole_text_rule(tok, req.output_ids, stops, True), req.output_ids
