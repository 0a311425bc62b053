"""The llguidance backend (`--grammar-backend llguidance`): a grammar is llguidance's JSON grammar text, checked
once per (kind, text) against the tokenizer under `LIMITS`; each request gets an `LLMatcher` of its own.

llguidance bounds its own work (lexer fuel when a grammar is built and per mask, Earley items per step, grammar
size), so a hostile schema or a catastrophic regex ends in an error, not in a compile that never returns. JSON is
compact (no free whitespace between tokens) and an object with listed properties admits no others unless its schema
says so (`closed_objects`, as xgrammar's strict mode, SGLang's default): a small model cannot then wander into a run
of blanks or of invented keys.
"""

from __future__ import annotations

import numpy as np

try:  # (installed with jaxdp; a server without it runs with --grammar-backend none)
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark
except ImportError:  # pragma: no cover
    llguidance = None

from jaxdp.grammar.base import GrammarError, Vocabulary, check_kind, closed_objects, schema_object, sentence

# llguidance's defaults divided by 4 for the work of building a grammar and of one mask: a server answers in
# milliseconds or refuses (its defaults are tuned for 100-1000 ms builds)
LIMITS = dict(initial_lexer_fuel=250_000, step_lexer_fuel=100_000, step_max_items=25_000, max_grammar_size=200_000,
              verbose_errors=False)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class LLGuidanceMatcher:
    """One request's matcher (the engine's `Matcher`)."""

    def __init__(self, inner: llguidance.LLMatcher, stop_ids: tuple[int, ...]):
        self.inner, self.stop_ids = inner, stop_ids

    def fill(self, bitmask_W: np.ndarray) -> None:
        self.inner.unsafe_compute_mask_ptr(bitmask_W.ctypes.data, bitmask_W.nbytes)

    def accept(self, token: int) -> bool:
        if token in self.stop_ids and self.inner.is_accepting():  # (after the grammar's end, llguidance is stopped)
            return True
        if self.inner.validate_tokens([token]) != 1:
            return False
        return self.inner.consume_token(token)

    def terminated(self) -> bool:
        return self.inner.is_stopped()

    def rollback(self, n: int) -> None:
        if not self.inner.rollback(n):
            raise RuntimeError(f"llguidance could not roll back {n} tokens: {self.inner.get_error()}")

    def reset(self) -> None:
        self.inner.reset()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, vocab: Vocabulary):
        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.vocab_size,
                                                eos_token=list(vocab.stop_ids))
        self.limits = llguidance.LLParserLimits(**LIMITS)

    def grammar_text(self, kind: str, text: str) -> str:
        """llguidance's grammar for a request's (kind, text)."""
        check_kind(kind, text)
        try:
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema_object(text)),
                                                              overrides=JSON_OPTIONS)
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(text)
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        except GrammarError:
            raise
        except Exception as e:  # (gbnf_to_lark raises its own error class)
            raise GrammarError(f"the {kind} cannot be read: {sentence(e)}") from None

    def compile(self, kind: str, text: str) -> Compiled:
        grammar = self.grammar_text(kind, text)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=self.limits)
        if error:
            raise GrammarError(f"the {kind} cannot be served: {sentence(error)}")
        return Compiled(grammar, self._new(grammar))

    def matcher(self, compiled: Compiled) -> LLGuidanceMatcher:
        """A request's matcher: a copy of the compiled grammar's untouched one (microseconds; building one from the
        grammar text parses it again, about a millisecond on the engine's loop for every constrained request)."""
        return LLGuidanceMatcher(compiled.template.deep_copy(), self.vocab.stop_ids)

    def _new(self, grammar: str) -> llguidance.LLMatcher:
        inner = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if inner.is_error():
            raise GrammarError(f"the grammar cannot be served: {sentence(inner.get_error())}")
        return inner


class Compiled:
    """A grammar checked against the tokenizer: its llguidance text and a matcher at its start that is never moved
    (each request's matcher is a copy of it)."""

    def __init__(self, grammar: str, template: llguidance.LLMatcher):
        self.grammar, self.template = grammar, template
