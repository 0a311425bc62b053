"""Grammars for structured outputs: the request's grammar (`kind`, `text`) compiled by a real grammar library
(llguidance by default, xgrammar as SGLang's other name), off the event loop and the scheduler's loop, cached and
bounded; a `Matcher` per request writes the token bitmask the compiled step applies. `Grammars` is the service a
server builds once (`--grammar-backend`) and gives to the engine and to the API."""

from jaxdp.grammar.backends import BACKENDS, DEFAULT_BACKEND, backend_problem, installed_backends
from jaxdp.grammar.base import (
    COMPILE_TIMEOUT_S,
    KINDS,
    MAX_GRAMMAR_CHARS,
    GrammarError,
    Matcher,
    Vocabulary,
    draft_bitmasks,
    vocabulary,
)
from jaxdp.grammar.service import Grammars

__all__ = ["BACKENDS", "COMPILE_TIMEOUT_S", "DEFAULT_BACKEND", "KINDS", "MAX_GRAMMAR_CHARS", "GrammarError",
           "Grammars", "Matcher", "Vocabulary", "backend_problem", "draft_bitmasks", "installed_backends", "vocabulary"]
