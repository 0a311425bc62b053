"""The streamed text (`jaxdp.api.common.TextView`): decoded incrementally, it equals the rule applied to the
whole output at every token (decode everything, cut before the first stop string, hold back a partial
character and a tail that could begin a stop string), for a byte-level tokenizer (partial UTF-8) and a
SentencePiece-style one (a leading space dropped at the start of a decode)."""

from __future__ import annotations

import random
import re

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from jaxdp.api.common import TextView
from jaxdp.engine.sched.request import (
    BadRequest,
    Request,
    SamplingParams,
    State,
    compile_stop_regexes,
    stop_string_check,
)
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


# ---- stop_regex and no_stop_trim (SGLang's) ----------------------------------------------------------------------

def whole_text_rule_re(tok, ids: list[int], stops: list[str], regexes: list[str], trim: bool) -> str | None:
    """The finished text at the first token whose text holds a stop string or a stop_regex match: cut before the
    leftmost one (after it with no_stop_trim); None while none is in it."""
    full = tok.decode(ids, skip_special_tokens=True)
    cuts = [(full.find(s), full.find(s) + len(s)) for s in stops if s in full]
    cuts += [m.span() for r in regexes if (m := re.search(r, full))]
    if not cuts:
        return None
    at, end = min(cuts)
    return full[: at if trim else end]


@pytest.mark.parametrize("trim", [True, False])
def test_stop_regex_and_no_stop_trim_cut_where_the_whole_text_rule_does(trim):
    """A stream with stop_regex (and stop strings) gives, at the token where the engine stops it, the text the
    rule gives for the whole output; with no_stop_trim the matched text stays. The engine's check
    (`stop_string_check`) stops the request at that same token."""
    tok = Tokenizer(default_model_path())
    stops, regexes = ["zz"], [r"\d+\.", r"a[bt]+a"]
    rng = random.Random(1)
    ids = [tok.encode(c)[-1] for c in "abtz.123 "]
    assert tok.decode(ids) == "abtz.123 "
    stopped = 0
    for _ in range(200):
        params = SamplingParams(stop=stops, stop_regex=regexes, no_stop_trim=not trim).validate()
        req, view = Request("r", [1], params), TextView(tok, stops, True, regexes, trim)
        check = stop_string_check(tok, stops, regexes)
        for _ in range(rng.randint(1, 40)):
            req.output_ids.append(rng.choice(ids))
            expect = whole_text_rule_re(tok, req.output_ids, stops, regexes, trim)
            assert check(req) == (expect is not None), req.output_ids
            if expect is not None:
                req.state = State.FINISHED
                assert view.text(req) == expect and view.matched in (*stops, *regexes), req.output_ids
                stopped += 1
                break
            text = view.text(req)  # running: a held-back prefix of the whole text
            assert tok.decode(req.output_ids).startswith(text)
    assert stopped > 100  # (the draws reach a stop most of the time)


def test_a_stop_regex_re2_cannot_read_is_one_sentence():
    with pytest.raises(BadRequest, match=r"stop_regex '\(\?<=a\)b' is not a regular expression this server reads"):
        SamplingParams(stop_regex=["(?<=a)b"]).validate()
    # linear time whatever the pattern: a pattern that backtracks for ages in Python's re answers at once
    r = compile_stop_regexes([r"(a+)+b"])[0]
    assert r.search("a" * 5000 + "c") is None
