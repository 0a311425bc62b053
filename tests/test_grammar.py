"""jaxdp.grammar against the libraries and against Python's own regex engine: each backend's Matcher walks a valid
output token by token, refuses a wrong token, and writes the bitmask the library computes by its own API; the
allowed sets of a small regex equal those enumerated from its language with `re`; the service caches, bounds
size and time, and answers a cached grammar while a slow compile runs."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxdp.grammar import (
    BACKENDS,
    MAX_GRAMMAR_CHARS,
    GrammarError,
    Grammars,
    Vocabulary,
    backend_problem,
    installed_backends,
)
from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer

TOKENIZER = Tokenizer(default_model_path())
VOCAB = Vocabulary(TOKENIZER.tok.to_str(), 512, (TOKENIZER.eos_token_id,))
BACKEND_NAMES = installed_backends()
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def allowed(bitmask_W: np.ndarray) -> set[int]:
    return {i for i in range(VOCAB.vocab_size) if (int(bitmask_W[i // 32]) >> (i % 32)) & 1}


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def backend(request):
    return BACKENDS[request.param](VOCAB)


def test_llguidance_is_installed_as_the_default():
    assert "llguidance" in BACKEND_NAMES
    assert backend_problem("llguidance") is None and backend_problem("none") is None
    assert "use one of" in backend_problem("outlines")


def test_a_json_output_is_accepted_token_by_token_and_ends_with_eos_only(backend):
    m = backend.matcher(backend.compile("json_schema", json.dumps(PERSON)))
    bitmask_W = np.zeros(VOCAB.bitmask_words, np.int32)
    for t in ids('{"name":"Ada","age":36}'):
        bitmask_W[:] = 0
        m.fill(bitmask_W)
        assert t in allowed(bitmask_W)
        assert TOKENIZER.eos_token_id not in allowed(bitmask_W)
        assert m.accept(t)
    m.fill(bitmask_W)
    assert allowed(bitmask_W) == {TOKENIZER.eos_token_id}
    assert m.terminated()


def test_a_wrong_token_is_refused_and_the_matcher_stays_where_it_was(backend):
    m = backend.matcher(backend.compile("json_schema", json.dumps(PERSON)))
    assert m.accept(ids("{")[0])
    before = np.zeros(VOCAB.bitmask_words, np.int32)
    m.fill(before)
    wrong = ids("x")[0]
    assert wrong not in allowed(before)
    assert not m.accept(wrong)
    after = np.zeros(VOCAB.bitmask_words, np.int32)
    m.fill(after)
    assert (after == before).all()
    m.reset()
    m.fill(before)
    assert allowed(before) == set(ids("{"))


def test_the_bitmask_is_the_librarys_own(backend):
    """Our fill against the library's other API for the same mask, along a regex's valid output."""
    compiled = backend.compile("regex", r"[a-z]{2,4}-\d{3}")
    ours, theirs = backend.matcher(compiled), backend.matcher(compiled)
    for t in ids("abc-123"):
        mine = np.zeros(VOCAB.bitmask_words, np.int32)
        ours.fill(mine)
        if backend.name == "llguidance":
            lib = np.frombuffer(theirs.inner.compute_bitmask(), dtype=np.int32)
        else:
            import torch
            import xgrammar
            mask = xgrammar.allocate_token_bitmask(1, VOCAB.vocab_size)
            theirs.inner.fill_next_token_bitmask(mask)
            lib = mask[0].numpy() if isinstance(mask, torch.Tensor) else np.asarray(mask[0])
        assert (mine == lib[: VOCAB.bitmask_words]).all()
        assert ours.accept(t) and theirs.accept(t)


def test_the_allowed_sets_of_a_regex_are_those_its_language_gives(backend):
    """An independent reference: the regex's (finite) language enumerated and checked with `re`; a character
    is allowed after a prefix exactly when some word of the language continues the prefix with it."""
    pattern = "(ab|b)[ac]{1,2}"
    language = {"".join(w) for n in range(1, 5) for w in itertools.product("abc", repeat=n)
                if re.fullmatch(pattern, "".join(w))}
    m = backend.matcher(backend.compile("regex", pattern))
    prefix = ""
    for step in "aba":
        bitmask_W = np.zeros(VOCAB.bitmask_words, np.int32)
        m.fill(bitmask_W)
        expected = {ids(w[len(prefix)])[0] for w in language if w.startswith(prefix) and len(w) > len(prefix)}
        if prefix in language:
            expected.add(TOKENIZER.eos_token_id)
        assert allowed(bitmask_W) == expected, prefix
        assert m.accept(ids(step)[0])
        prefix += step


@pytest.mark.parametrize("kind,text,words", [
    ("json_schema", "{", "not JSON text"),
    ("json_schema", "[1]", "must be a JSON object"),
    ("regex", "([a-z]", "regex"),
    ("ebnf", 'root ::= "a" (', "ebnf"),
    ("xml", "<a/>", "must be one of"),
    ("regex", "a" * (MAX_GRAMMAR_CHARS + 1), "more than the"),
])
def test_a_grammar_that_cannot_be_served_is_one_sentence(backend, kind, text, words):
    with pytest.raises(GrammarError) as e:
        backend.compile(kind, text)
    message = str(e.value)
    assert words in message and "\n" not in message and len(message) < 300


class SlowBackend:
    """A backend whose compile of "slow" takes `seconds`: the service's bounds, without a library."""

    name = "slow"

    def __init__(self, seconds: float):
        self.seconds, self.compiles = seconds, []
        self.release = threading.Event()

    def compile(self, kind: str, text: str):
        self.compiles.append(text)
        if text == "slow":
            self.release.wait(self.seconds)
        if text == "bad":
            raise GrammarError("the regex cannot be served: bad")
        return text

    def matcher(self, compiled):
        return SimpleNamespace(compiled=compiled)


def spec(text: str, kind: str = "regex") -> SimpleNamespace:
    return SimpleNamespace(kind=kind, text=text)


def test_the_service_caches_by_kind_and_text():
    slow = SlowBackend(0)
    grammars = Grammars(slow)
    a, b = grammars.start(spec("x")).result(5), grammars.start(spec("x")).result(5)
    grammars.start(spec("x", "ebnf")).result(5)
    assert a is not b and a.compiled == b.compiled == "x"  # a matcher per request, one compile per (kind, text)
    assert slow.compiles == ["x", "x"]
    with pytest.raises(GrammarError):
        grammars.start(spec("bad")).result(5)
    with pytest.raises(GrammarError):
        grammars.check(spec("bad")).result(5)
    assert slow.compiles.count("bad") == 1
    grammars.close()


def test_a_compile_past_the_time_limit_is_refused_and_never_delays_a_cached_grammar():
    slow = SlowBackend(30)
    grammars = Grammars(slow, timeout_s=0.3, workers=1)
    grammars.start(spec("fast")).result(5)
    t0 = time.perf_counter()
    pending = grammars.start(spec("slow"))
    assert grammars.start(spec("fast")).result(1).compiled == "fast"  # served while "slow" compiles
    assert time.perf_counter() - t0 < 0.25
    with pytest.raises(GrammarError, match="did not compile within 0.3 s"):
        pending.result(5)
    with pytest.raises(GrammarError, match="busy"):  # its worker is still held: a new grammar is refused at once
        grammars.start(spec("other")).result(1)
    with pytest.raises(GrammarError, match="did not compile"):  # the hostile one is refused at once from the cache
        grammars.start(spec("slow")).result(1)
    slow.release.set()
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            assert grammars.start(spec("other")).result(5).compiled == "other"
            break
        except GrammarError:
            time.sleep(0.05)
    else:
        raise AssertionError("the worker was not given back after the slow compile returned")
    grammars.close()


def test_hostile_grammars_are_refused_or_bounded():
    """A deeply nested schema and catastrophic regexes: an answer within the time limit, whatever it is, from the
    default backend (xgrammar has no bound of its own: a compile it does not finish would hold a core for the rest
    of the suite; `python -m jaxdp.bench.grammar` measures it in a child process it kills)."""
    name = "llguidance"
    nested: dict = {"type": "object", "properties": {}}
    node = nested
    for _ in range(200):
        node["properties"]["a"] = node = {"type": "object", "properties": {}}
    grammars = Grammars(BACKENDS[name](VOCAB), timeout_s=2.0)
    for s in (spec(json.dumps(nested), "json_schema"), spec("(a|b)*a(a|b){24}"), spec("((a{1,50}){1,50}){1,50}b")):
        t0 = time.perf_counter()
        future = grammars.start(s)
        try:
            future.result(4)
        except GrammarError as e:
            assert "\n" not in str(e)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"{name}: no answer within 4 s for {s.text[:40]}") from None
        assert time.perf_counter() - t0 < 4
    grammars.close()


def test_objects_admit_only_their_listed_properties_unless_they_say_otherwise(backend):
    """As xgrammar's strict mode (SGLang's default): an extra key is refused where the schema lists properties
    and says nothing of others, served where it allows them."""
    def accepts(schema: dict, text: str) -> bool:
        m = backend.matcher(backend.compile("json_schema", json.dumps(schema)))
        return all(m.accept(t) for t in ids(text))

    listed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    nested = {"type": "array", "items": {"anyOf": [listed]}}
    assert accepts(listed, '{"a":1}') and not accepts(listed, '{"a":1,"b":2}')
    assert not accepts(nested, '[{"a":1,"b":2}]')
    assert accepts(listed | {"additionalProperties": True}, '{"a":1,"b":2}')


REGEX_ATOMS = st.sampled_from(["a", "b", "[a-z]", r"\d", ".", "(a|aa)", "[^x]"])


def _regex(draw_atom, depth: int):
    return st.recursive(draw_atom, lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["*", "+", "?", "{1,50}", "{20}", "{0,200}"])).map(
            lambda t: f"({t[0]}){t[1]}"),
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")")), max_leaves=depth)


SCHEMAS = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "string", "pattern": "a{1,30}b"},
                     {"enum": ["x", "y", "z"]}, {"type": "number"}, {"type": "string", "minLength": 5000}]),
    lambda inner: st.one_of(
        st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, min_size=1, max_size=4).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props)}),
        inner.map(lambda item: {"type": "array", "items": item, "minItems": 1, "maxItems": 300}),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs})), max_leaves=30)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_regex(REGEX_ATOMS, 12).map(lambda r: ("regex", r)),
                 SCHEMAS.map(lambda s: ("json_schema", json.dumps(s)))))
def test_fuzzed_regexes_and_schemas_are_answered_within_the_bound(grammar):
    """Nested quantifiers, alternations, deep and wide schemas (hypothesis, derandomized): every one is served or
    refused in one sentence within the service's time limit, and a matcher's first mask comes within a second."""
    kind, text = grammar
    t0 = time.perf_counter()
    try:
        m = FUZZ_SERVICE.start(SimpleNamespace(kind=kind, text=text)).result(FUZZ_SERVICE.timeout_s + 1)
    except GrammarError as e:
        assert "\n" not in str(e)
        return
    assert time.perf_counter() - t0 < FUZZ_SERVICE.timeout_s + 1
    t0 = time.perf_counter()
    m.fill(np.zeros(VOCAB.bitmask_words, np.int32))
    assert time.perf_counter() - t0 < 1.0, text[:80]


FUZZ_SERVICE = Grammars(BACKENDS["llguidance"](VOCAB), timeout_s=2.0)


def test_terminated_means_nothing_but_the_stop_token_is_left(backend):
    """`a+` after one a could go on: not terminated; `ab` after ab: terminated (the same on both backends)."""
    more, done = backend.matcher(backend.compile("regex", "a+")), backend.matcher(backend.compile("regex", "ab"))
    assert more.accept(ids("a")[0]) and not more.terminated()
    assert all(done.accept(t) for t in ids("ab")) and done.terminated()


def test_a_backend_that_cannot_read_the_tokenizer_leaves_the_server_serving_without_grammars(tmp_path, caplog):
    """llguidance takes no tokenizer.json without a decoder (the peer checkpoint's bare word-level one): the server
    starts without structured outputs and says why in one log line, rather than dying at start-up; a backend that
    reads it (xgrammar) is kept, and so is llguidance with a tokenizer it reads."""
    from jaxdp.bench.peer_model import write_tokenizer
    from jaxdp.serve import build_parser, serve_config, with_readable_grammars
    from jaxdp.tokenizer import Tokenizer

    write_tokenizer(tmp_path, 4096)
    words = Tokenizer.from_dir(tmp_path)
    default = serve_config(build_parser().parse_args([]))
    assert default.engine.grammar_backend == "llguidance"
    with caplog.at_level("WARNING", logger="jaxdp.serve"):
        served = with_readable_grammars(default, words)
    assert served.engine.grammar_backend == "none"
    assert "--grammar-backend llguidance cannot read this model's tokenizer" in caplog.text
    assert with_readable_grammars(default, Tokenizer.from_dir(default.tokenizer_path)) is default
    assert with_readable_grammars(default, None) is default
    if "xgrammar" in installed_backends():
        given = serve_config(build_parser().parse_args(["--grammar-backend", "xgrammar"]))
        assert with_readable_grammars(given, words) is given
