"""Issue 46 points 2, 3 and 6 end to end: structured outputs and forced tool calls of the embedded default model,
with the real openai client against the app in process (httpx's ASGI transport) over a real Engine given the
grammar service (`--grammar-backend llguidance`, the default). Each output is checked by something independent of
the grammar: jsonschema for JSON, `re.fullmatch` for a regex, the tools' own schemas for a call's arguments.

One engine (dp=2) is shared by every test of the module; each request is short (max_tokens <= 96)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client import CollectorRegistry, Counter

from jaxdp.api.app import create_app
from jaxdp.api.parsers.forced_calls import ToolCallArrayReader
from jaxdp.engine import Engine
from jaxdp.engine.options import EngineConfig, SpeculativeConfig
from jaxdp.grammar import Grammars, vocabulary
from jaxdp.serve import build_parser
from jaxdp.serve_config import UserError, serve_config

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def engine():
    config = EngineConfig(page_size=16, num_pages=64, max_running_requests=8, chunked_prefill_size=512,
                          decode_buckets=[4], extend_buckets=[256])
    eng = Engine("default", "dp=2", config, grammars=None)
    eng.grammars = Grammars.create("llguidance", vocabulary(eng.tokenizer, eng.runner.cfg.vocab_size))
    eng.accepts_grammars = True
    eng.start()
    yield eng
    eng.shutdown()


def app_over(engine, grammars="engine's"):
    metrics = SimpleNamespace(http_errors=Counter("http_errors", "", ["status"], registry=CollectorRegistry()))
    return create_app(engine, metrics=metrics, grammars=engine.grammars if grammars == "engine's" else grammars)


def run(app, calls):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:30000", timeout=120) as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none", http_client=http,
                                        max_retries=0)
            return await calls(client, http)

    return asyncio.run(main())


MESSAGES = [{"role": "user", "content": "Ada is 36."}]


def test_response_format_json_schema_validates_and_parse_returns_an_object(engine):
    async def calls(client, http):
        schema = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=64, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
        sampled = await client.chat.completions.create(
            model="default", messages=MESSAGES, max_tokens=64, temperature=1.0, seed=3, n=3,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        obj = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=64, temperature=0,
                                                   response_format={"type": "json_object"})
        parsed = await client.chat.completions.parse(model="default", messages=MESSAGES, max_tokens=64,
                                                     temperature=0, response_format=Person)
        return schema, sampled, obj, parsed

    schema, sampled, obj, parsed = run(app_over(engine), calls)
    for choice in schema.choices + sampled.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # (any JSON object: the small model may open a key it never closes; then max_tokens ends it, "length")
    text, finish = obj.choices[0].message.content, obj.choices[0].finish_reason
    assert isinstance(json.loads(text), dict) if finish == "stop" else (finish == "length" and text[0] == "{"), text
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_sglang_regex_ebnf_and_json_schema_on_every_endpoint(engine):
    pattern = r"\d{1,3}-[a-z]{2,5}"

    async def calls(client, http):
        completion = await client.completions.create(model="default", prompt="37+48=", max_tokens=16, temperature=0,
                                                     extra_body={"regex": pattern})
        chat = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=64,
                                                    temperature=0, extra_body={"json_schema": json.dumps(PERSON)})
        native = await http.post("/generate", json={"text": "6*7=", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ebnf": 'root ::= "yes" | "no"'}})
        stream = await client.completions.create(model="default", prompt="37+48=", max_tokens=16, stream=True,
                                                 temperature=0, extra_body={"regex": pattern})
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        two = await http.post("/v1/completions", json={"prompt": "1+1=", "regex": "a", "ebnf": 'root ::= "a"'})
        mixed = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "regex": "a",
                                                               "response_format": {"type": "json_object"}})
        bad = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "regex": "([a-z]"})
        return completion, chat, native, streamed, two, mixed, bad

    completion, chat, native, streamed, two, mixed, bad = run(app_over(engine), calls)
    assert re.fullmatch(pattern, completion.choices[0].text), completion.choices[0].text
    assert completion.choices[0].finish_reason == "stop"
    assert streamed == completion.choices[0].text
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    assert native.status_code == 200 and native.json()["text"] in ("yes", "no"), native.text
    for response, words in ((two, "regex and ebnf are both set; send one grammar"),
                            (mixed, "response_format and regex both constrain the output; send one of them"),
                            (bad, "regex: the regex cannot be")):
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert words in message and "\n" not in message, message


def call_of(call) -> tuple[str, dict]:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return call.function.name, arguments


def test_tool_choice_required_and_named_return_valid_calls(engine):
    messages = [{"role": "user", "content": "What is 37+48?"}]

    async def calls(client, http):
        required = await client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                                        tool_choice="required", max_tokens=96, temperature=0)
        named = await client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, max_tokens=96, temperature=0, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        pieces = {}
        async for chunk in await client.chat.completions.create(model="default", messages=messages, tools=TOOLS,
                                                                 tool_choice="required", max_tokens=96,
                                                                 temperature=0, stream=True):
            for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = pieces.setdefault(piece.index, {"name": piece.function.name, "arguments": ""})
                entry["arguments"] += piece.function.arguments or ""
        unknown = await http.post("/v1/chat/completions", json={
            "messages": messages, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
        return required, named, pieces, unknown

    required, named, pieces, unknown = run(app_over(engine), calls)
    choice = required.choices[0]  # (parallel calls: the small model may go on calling until max_tokens)
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None, choice
    got = [call_of(c) for c in choice.message.tool_calls]
    assert got and all(c.id.startswith("call_") for c in choice.message.tool_calls)
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(pieces.items())] == got
    named_calls = named.choices[0].message.tool_calls
    assert len(named_calls) == 1 and call_of(named_calls[0])[0] == "get_weather"
    assert named.choices[0].finish_reason == "tool_calls"  # (one call: the grammar's end ends the answer)
    assert unknown.status_code == 400 and "must name one of the request's tools" in unknown.json()["error"]["message"]


def test_a_hostile_grammar_is_refused_without_delaying_a_plain_request(engine):
    nested: dict = {"type": "object", "properties": {}}
    node = nested
    for _ in range(200):
        node["properties"]["a"] = node = {"type": "object", "properties": {}}

    async def calls(client, http):
        plain_alone_t0 = time.perf_counter()
        await client.completions.create(model="default", prompt="23*4=", max_tokens=8, temperature=0)
        alone = time.perf_counter() - plain_alone_t0
        t0 = time.perf_counter()
        hostile = [http.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 4, **body}) for body in (
            {"json_schema": nested}, {"regex": "((a{1,50}){1,50}){1,50}b"}, {"regex": "x" * 70000})]
        plain = client.completions.create(model="default", prompt="23*4=", max_tokens=8, temperature=0)
        *answers, plain_answer = await asyncio.gather(*hostile, plain)
        return alone, time.perf_counter() - t0, answers, plain_answer

    alone, together, answers, plain = run(app_over(engine), calls)
    assert plain.choices[0].text and plain.choices[0].finish_reason in ("stop", "length")
    for response in answers:
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:
            assert "\n" not in response.json()["error"]["message"]
    assert answers[0].status_code == 400 and answers[2].status_code == 400
    assert together < alone + 5.0, (alone, together)


def test_a_server_without_a_grammar_backend_refuses_grammars_in_one_sentence(engine):
    async def calls(client, http):
        return await http.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                              "response_format": {"type": "json_object"}})

    response = run(app_over(engine, grammars=None), calls)
    assert response.status_code == 400
    assert "--grammar-backend none" in response.json()["error"]["message"]


@pytest.mark.parametrize("flags,expect", [
    ([], "llguidance"),
    (["--grammar-backend", "none"], "none"),
    (["--speculative-algorithm", "EAGLE"], "llguidance"),
    (["--speculative-algorithm", "EAGLE", "--grammar-backend", "none"], "none"),
    (["--speculative-algorithm", "EAGLE", "--grammar-backend", "llguidance"], "llguidance"),
    (["--grammar-backend", "outlines"], "use one of llguidance, xgrammar or none"),
])
def test_the_grammar_backend_flag(flags, expect):
    parser = build_parser()
    try:
        assert serve_config(parser.parse_args(flags)).engine.grammar_backend == expect
    except UserError as e:
        assert expect in str(e) and "\n" not in str(e)


def test_a_forced_answer_reads_the_same_streamed_in_any_pieces_as_whole():
    """ToolCallArrayReader: the grammar's JSON array of calls, fed in pieces of every size, gives exactly the calls
    of the whole text (a brace inside a string included); text that is not an array stays content."""
    text = ('[{"name":"get_weather","parameters":{"city":"Pa}ris","unit":"c"}},'
            '{"name":"add","parameters":{"a":1,"b":2}}]')
    whole = ToolCallArrayReader(lambda i: f"c{i}").feed(text)
    assert [(d.index, d.name, json.loads(d.arguments)) for d in whole] == [
        (0, "get_weather", {"city": "Pa}ris", "unit": "c"}), (1, "add", {"a": 1, "b": 2})]
    for size in range(1, 12):
        reader = ToolCallArrayReader(lambda i: f"c{i}")
        pieces = [p for k in range(0, len(text), size) for p in reader.feed(text[k:k + size])] + reader.finish()
        assert pieces == whole, size
    assert ToolCallArrayReader().feed("no calls") == ["no calls"]


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_200_sampled_constrained_outputs_at_dp8_all_validate(speculative):
    """Issue 46's validity goal: 200 constrained answers of the default model, sampled (temperature 1, a seed each)
    on a dp=8 engine through the API, a third each a JSON schema, a regex and a forced tool call, all validate
    (jsonschema, re.fullmatch, the tool's schema), without and with speculative decoding (MTP drafts checked
    against the grammar in the verify). Bounded strings and numbers: the model is small (README)."""
    config = EngineConfig(page_size=16, num_pages=32, max_running_requests=64, chunked_prefill_size=1024,
                          decode_buckets=[8], extend_buckets=[256],
                          speculative=SpeculativeConfig() if speculative else None)
    eng = Engine("default", "dp=8", config)
    eng.grammars = Grammars.create("llguidance", vocabulary(eng.tokenizer, eng.runner.cfg.vocab_size))
    eng.accepts_grammars = True
    eng.start()
    pattern = r"[a-z]{2,6}-\d{1,3}"

    async def one(client, i: int):
        kind = i % 3
        common = {"model": "default", "max_tokens": 96, "temperature": 1.0, "seed": i}  # (a call is ~70 bytes)
        if kind == 0:
            r = await client.chat.completions.create(messages=MESSAGES, **common, response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        elif kind == 1:
            r = await client.completions.create(prompt=f"{i}+{i}=", extra_body={"regex": pattern}, **common)
            assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
        else:
            r = await client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                     parallel_tool_calls=False, **common)
            (call,) = r.choices[0].message.tool_calls
            call_of(call)
        return r.choices[0].finish_reason

    async def calls(client, http):
        return await asyncio.gather(*(one(client, i) for i in range(200)), return_exceptions=True)

    try:
        finishes = run(app_over(eng), calls)
    finally:
        eng.shutdown()
    failed = [(i, f) for i, f in enumerate(finishes) if f not in ("stop", "tool_calls")]
    assert not failed, failed[:5]
