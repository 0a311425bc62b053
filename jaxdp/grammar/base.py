"""What every grammar backend shares: the request's grammar as the engine carries it (kind and text), the bounds
on it, the one error a client sees, and the matcher the engine drives.

A grammar comes from a request in one of four kinds (SGLang's sampling parameters and OpenAI's `response_format`):
`json_schema` (the schema's JSON text), `json_object` (any JSON object; the text is ignored), `regex`, `ebnf`
(GBNF, as SGLang and llama.cpp write it). A backend compiles it for one tokenizer and gives a `Matcher` per request:
`fill` writes the next token's allowed set as a bitmask (bit j of word i allows token 32*i + j), `accept` moves on
by a sampled token (False, and no move, when the grammar does not allow it), `terminated` says the grammar has
ended (only the stop token is allowed after it), `rollback` undoes the last n accepted tokens, `reset` starts over.
A speculative verify's K + 1 positions each get the mask after the drafts before them (`draft_bitmasks`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Protocol

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "ebnf")

# the longest grammar text a request may send (characters): a JSON schema of a few dozen tools is ~20 KB
MAX_GRAMMAR_CHARS = 65536
# the longest one compile may take before the request is answered that its grammar is too complex (seconds)
COMPILE_TIMEOUT_S = 5.0


class GrammarError(ValueError):
    """A grammar that cannot be served, said in one sentence that names what to change."""


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """What a backend needs of the tokenizer: tokenizer.json's text, the model's vocabulary size (the LM head's
    width, which may exceed the tokenizer's), and the ids that end an output."""

    tokenizer_json: str
    vocab_size: int
    stop_ids: tuple[int, ...]

    @property
    def bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32


class Matcher(Protocol):
    def fill(self, bitmask_W: np.ndarray) -> None: ...

    def accept(self, token: int) -> bool: ...

    def terminated(self) -> bool: ...

    def rollback(self, n: int) -> None: ...

    def reset(self) -> None: ...


class Backend(Protocol):
    """One grammar library. `compile` may take long (it runs on the grammar thread pool) and raises GrammarError for
    a grammar it cannot serve; `matcher` is cheap."""

    name: str

    def compile(self, kind: str, text: str) -> object: ...

    def matcher(self, compiled: object) -> Matcher: ...


def check_kind(kind: str, text: str) -> None:
    """The bounds every backend shares: a known kind, text within MAX_GRAMMAR_CHARS."""
    if kind not in KINDS:
        raise GrammarError(f"a grammar's kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {kind} is {len(text)} characters, more than the {MAX_GRAMMAR_CHARS} a grammar may "
                           "have; send a smaller one")


def schema_object(text: str) -> dict:
    """A json_schema's text as the object it must be."""
    try:
        schema = json.loads(text)
    except ValueError:
        raise GrammarError("the json_schema is not JSON text; send a JSON Schema object") from None
    if not isinstance(schema, dict):
        raise GrammarError("the json_schema must be a JSON object (a JSON Schema)")
    return schema


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else",
                  "propertyNames", "additionalProperties", "unevaluatedProperties", "anyOf", "oneOf", "prefixItems")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """A copy of a JSON Schema whose objects with listed properties admit no others unless they say so
    (additionalProperties false where none of additionalProperties, unevaluatedProperties, patternProperties is
    given): xgrammar's strict mode, SGLang's default, which keeps a small model from inventing keys forever.
    The members of an allOf are left as they are (closing one would refuse the others' properties)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_VALUES:
            out[key] = closed_objects(value)
    if "properties" in schema and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def sentence(error: object) -> str:
    """A library's message as the end of one sentence: its first line without a log prefix (`[time] file:line: `),
    at most 200 characters."""
    lines = str(error).strip().splitlines()
    line = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else "unknown error"
    return line[:200].rstrip(".: ") or "unknown error"


def allows(bitmask_W: np.ndarray, token: int) -> bool:
    """Whether a bitmask allows `token`."""
    return 0 <= token < 32 * bitmask_W.shape[-1] and bool((int(bitmask_W[token // 32]) >> (token % 32)) & 1)


def draft_bitmasks(matcher: Matcher, drafts: list[int], stop_ids: tuple[int, ...], out_JW: np.ndarray) -> int:
    """A speculative verify's masks for one request (`out_JW`: its D + 1 positions' bitmasks, written): position j
    gets what the grammar allows after drafts[:j], the matcher advanced through them and rolled back to where it
    was. The chain ends at the first draft the grammar does not allow (that position's mask leaves it out, so it
    cannot be accepted and acceptance stops there), at a stop token or where the grammar ends; the positions after
    it copy its mask (acceptance never reaches them). Returns the drafts the chain went through."""
    matcher.fill(out_JW[0])
    went = filled = 0
    for j, token in enumerate(drafts[: len(out_JW) - 1], 1):
        if token in stop_ids or not allows(out_JW[j - 1], token) or not matcher.accept(token):
            break
        went += 1
        if matcher.terminated():  # (the request ends at this draft if it is accepted)
            break
        matcher.fill(out_JW[j])
        filled = j
    out_JW[filled + 1:] = out_JW[filled]
    if went:
        matcher.rollback(went)
    return went


def vocabulary(tokenizer: Any, vocab_size: int) -> Vocabulary | None:
    """The Vocabulary of a jaxdp Tokenizer (None without one, or without an end-of-sequence token): its
    tokenizer.json, the model's vocabulary size, its eos id."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return None
    return Vocabulary(tokenizer.tok.to_str(), vocab_size, (tokenizer.eos_token_id,))
