"""Structured outputs on the API: the grammar a request asks for, checked by compiling it, as the
`SamplingParams.grammar` the engine constrains decoding with.

Where a grammar comes from (at most one per request, as SGLang: two are a 400):
- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}` (the schema is followed exactly, strict or not);
- SGLang's `json_schema` (a schema as JSON text or as an object), `regex`, `ebnf`: at the top of an OpenAI request
  (SGLang's extras) and in /generate's `sampling_params`;
- chat's `tool_choice: "required"` or a named function: the tools' calls as a JSON array (`tool_calls_schema`).

The API compiles each grammar before the request is queued (on the grammar service's threads: the event loop only
awaits it), so a grammar the backend cannot serve is a 400 in one sentence and never reaches a rank; the engine's
own compile of it is then a cache hit or a compile of the same text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from jaxdp.api.common import ApiError
from jaxdp.api.fields import field
from jaxdp.engine.sched.request import GrammarSpec
from jaxdp.grammar import GrammarError, Grammars

SGLANG_FIELDS = ("json_schema", "regex", "ebnf")


def sglang_grammar(body: dict, where: str = "") -> GrammarSpec | None:
    """SGLang's json_schema / regex / ebnf in `body` (one at most)."""
    given = [name for name in SGLANG_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise ApiError(f"{where}{given[0]} and {where}{given[1]} are both set; send one grammar "
                       "(json_schema, regex or ebnf)", param=given[1])
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "json_schema" and isinstance(value, dict):
        return GrammarSpec("json_schema", json.dumps(value))
    return GrammarSpec(name, field(body, name, str, where=where))


def response_format(body: dict) -> GrammarSpec | None:
    """OpenAI's response_format as a grammar (None for text)."""
    rf = field(body, "response_format", dict)
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        spec = field(rf, "json_schema", dict, where="response_format.")
        if spec is None or not isinstance(spec.get("schema", {}), dict):
            raise ApiError('response_format.json_schema must be {"name": ..., "schema": {...}, "strict": ...}',
                           param="response_format")
        field(spec, "strict", bool, where="response_format.json_schema.")
        field(spec, "name", str, where="response_format.json_schema.")
        schema = spec.get("schema")
        return GrammarSpec("json_schema", json.dumps(schema if schema is not None else {}))
    raise ApiError(f'response_format.type must be "text", "json_object" or "json_schema", got {str(kind)[:40]!r}',
                   param="response_format")


def openai_grammar(body: dict, forced_calls: dict[str, Any] | None = None) -> tuple[str, GrammarSpec | None]:
    """An OpenAI request's grammar and the field it comes from: response_format, SGLang's json_schema / regex /
    ebnf, or chat's forced tool calls (their schema); at most one of them. ("", None) without one."""
    given = [(name, spec) for name, spec in (
        ("response_format", response_format(body)),
        (next((n for n in SGLANG_FIELDS if body.get(n) is not None), "json_schema"), sglang_grammar(body)),
        ("tool_choice", None if forced_calls is None else GrammarSpec("json_schema", json.dumps(forced_calls))))
        if spec is not None]
    if len(given) > 1:
        raise ApiError(f"{given[0][0]} and {given[1][0]} both constrain the output; send one of them",
                       param=given[1][0])
    return given[0] if given else ("", None)


async def checked(grammars: Grammars | None, spec: GrammarSpec | None, param: str) -> GrammarSpec | None:
    """`spec` once the server's backend has compiled it (off the event loop), or the 400 that says why not."""
    if spec is None:
        return None
    if grammars is None:
        raise ApiError(f"{param} needs constrained decoding, and this server serves no grammars (--grammar-backend "
                       "none, or a backend that cannot read its tokenizer: its start-up log says which); leave it "
                       "out, or start the server with a grammar backend that reads the model's tokenizer",
                       param=param)
    try:
        await asyncio.wrap_future(grammars.check(spec))
    except GrammarError as e:
        raise ApiError(f"{param}: {e}", param=param) from None
    return spec


def tool_calls_schema(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any]:
    """The JSON Schema of a tool-call answer under tool_choice "required" (a call of any tool) or a named function
    (a call of that one): a JSON array of {"name", "parameters"} objects, one call unless `parallel` (SGLang's
    format for a forced call, which `ToolCallArrayReader` reads)."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not isinstance(name, str) or not chosen:
            raise ApiError('tool_choice must name one of the request\'s tools: {"type": "function", "function": '
                           '{"name": ...}}', param="tool_choice")
        tools = chosen
    calls = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "parameters": t["function"].get("parameters") or {"type": "object", "properties": {}}},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return array
