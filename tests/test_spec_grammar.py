"""Grammars inside the verify step (`jaxdp.engine.step.spec.verify_bitmask`, `jaxdp.grammar.base.draft_bitmasks`):
each of a constrained request's D + 1 verify positions gets the bitmask its grammar allows after the drafts before
it (its matcher walked through them and rolled back), a draft the grammar rejects is left out of its own position
so it is never accepted, and the matcher moves on by the tokens booked. Checked: the masks against a fresh matcher
walked by hand (llguidance and xgrammar); on the embedded default model (whose MTP layer drafts for real)
constrained greedy outputs (json_schema, regex) of a speculating dp=8 engine equal the plain engine's tokens and
validate (jsonschema, re.fullmatch); the same engine with the masks left out of the verify (`verify_bitmask`
returning None) does not give valid outputs, so the comparison would fail if the verify ignored them. 32 requests:
`-m slow`."""

from __future__ import annotations

import json
import re

import jax
import jsonschema
import numpy as np
import pytest

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.options import SpeculativeConfig
from jaxdp.engine.sched.request import GrammarSpec
from jaxdp.engine.step import spec as spec_module
from jaxdp.grammar import Grammars, draft_bitmasks, vocabulary
from jaxdp.grammar.base import allows
from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer

HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
pytestmark = pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model (with its tokenizer) is absent")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
PATTERN = r"[a-z]{2,6}-\d{1,3}"
MAX_NEW = 40


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_the_verify_positions_masks_are_the_matchers_after_each_draft(backend):
    """`draft_bitmasks` against a fresh matcher walked by hand: position j is the mask after drafts[:j] while the
    grammar accepts them; a draft it rejects is not allowed at its own position and the positions after copy that
    mask; the request's matcher ends where it started (rolled back)."""
    tok = Tokenizer.from_dir(default_model_path())
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    vocab = vocabulary(tok, tok.vocab_size)
    grammars = Grammars.create(backend, vocab)
    matcher = lambda: grammars.start(GrammarSpec("regex", PATTERN)).result(10)  # noqa: E731  (at its start)
    ids = lambda text: e if isinstance(e := tok.encode(text), list) else e.ids  # noqa: E731
    W = vocab.bitmask_words
    good, digit = ids("abc-42"), ids("7")[-1]
    cases = (good[:3], good, good[:1] + [digit] + good[1:2], [digit, good[0]], good[:1] * 5)
    rejected = 0
    for drafts in cases:
        D = len(drafts)
        req = matcher()
        before, after = np.zeros(W, np.int32), np.zeros(W, np.int32)
        req.fill(before)
        out = np.zeros((D + 1, W), np.int32)
        went = draft_bitmasks(req, drafts, vocab.stop_ids, out)
        req.fill(after)
        assert (after == before).all()
        hand = matcher()
        expect = np.zeros((D + 1, W), np.int32)
        hand.fill(expect[0])
        n = 0
        for j, t in enumerate(drafts, 1):
            if not allows(expect[j - 1], t):
                rejected += 1
                break
            assert hand.accept(t)
            n = j
            hand.fill(expect[j])
        expect[n + 1:] = expect[n]
        assert went == n and (out == expect).all(), drafts
        if n < D:
            assert not allows(out[n], drafts[n])  # (the rejected draft: p = 0 at its own position)
        assert len({out[j].tobytes() for j in range(n + 1)}) > 1 or n == 0  # (the masks differ along the chain)
    assert rejected >= 2


def requests(tok, n: int) -> list[tuple[list[int], SamplingParams]]:
    """n constrained greedy requests, alternating a JSON schema and a regex, over varied prompts."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            prompt, grammar = f"person {i}: ", GrammarSpec("json_schema", json.dumps(PERSON))
        else:
            prompt, grammar = f"{i}+{i}=", GrammarSpec("regex", PATTERN)
        enc = tok.encode(prompt)
        out.append((enc if isinstance(enc, list) else enc.ids,
                    SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, grammar=grammar)))
    return out


def serve(mesh_spec: str, speculative: bool, n: int, ignore_masks: bool = False, monkeypatch=None):
    """The constrained greedy answers (ids, text, finish reason) of a default-model engine, and the drafts it
    accepted (speculating)."""
    dp = int(mesh_spec.split(",")[0][3:]) if mesh_spec.startswith("dp=") else 1
    config = EngineConfig(max_running_requests=2 * dp, chunked_prefill_size=64 * dp, decode_buckets=[2],
                          extend_buckets=[64], context_length=128, disable_cuda_graph=not speculative,
                          speculative=SpeculativeConfig() if speculative else None)
    if ignore_masks:
        monkeypatch.setattr(spec_module, "verify_bitmask", lambda *a: None)
    with jax.default_matmul_precision("highest"):
        e = Engine("default", mesh_spec, config, dtype="float32")
        e.grammars = Grammars.create("llguidance", vocabulary(e.tokenizer, e.runner.cfg.vocab_size))
        e.accepts_grammars = True
        try:
            reqs = requests(e.tokenizer, n)
            got = e.generate([p for p, _ in reqs], [s for _, s in reqs])
            if speculative and not ignore_masks:
                assert e.stats.compiles_in_steps == 0  # (the masks are an input of the steps compiled at start-up)
            answers = [(r.output_ids, e.tokenizer.decode(r.output_ids), r.finish_reason) for r in got]
            return answers, sum(r.spec_accepted for r in got) if speculative else 0
        finally:
            e.shutdown()


def valid(i: int, text: str) -> bool:
    try:
        if i % 2 == 0:
            jsonschema.validate(json.loads(text), PERSON)
            return True
        return re.fullmatch(PATTERN, text) is not None
    except (ValueError, jsonschema.ValidationError):
        return False


def check(mesh_spec: str, n: int) -> None:
    plain, _ = serve(mesh_spec, False, n)
    spec, accepted = serve(mesh_spec, True, n)
    assert [a[0] for a in spec] == [a[0] for a in plain]
    assert [a[2] for a in spec] == [a[2] for a in plain]
    for i, (_, text, reason) in enumerate(spec):
        assert reason == "stop" and valid(i, text), (i, text, reason)
    assert accepted > n  # (drafts were accepted under the grammar)


@pytest.mark.slow  # (two dp=8 engines: about 4 minutes of compiles on a fresh cache; the masks' test below stays)
def test_constrained_greedy_outputs_are_the_same_with_and_without_speculation_dp8():
    check("dp=8", 8)


@pytest.mark.slow
def test_constrained_greedy_outputs_are_the_same_with_and_without_speculation_dp8_many():
    check("dp=8", 32)


def test_a_verify_without_the_masks_gives_invalid_outputs(monkeypatch):
    """The same speculating engine with the verify's masks left out (padding instead): some answer breaks its
    grammar (the matcher refuses a token it booked, or the text does not validate), so the tests above would fail
    if the verify ignored the masks."""
    spec, _ = serve("dp=8", True, 8, ignore_masks=True, monkeypatch=monkeypatch)
    assert any(reason != "stop" or not valid(i, text) for i, (_, text, reason) in enumerate(spec))
