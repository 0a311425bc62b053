"""Issue 46 point 1: nothing a request asks is silently ignored. OpenAI's request schemas (read from the installed
openai client's types) and SGLang's /generate and sampling parameters (written from SGLang's documentation) are
walked field by field against the one field table (`jaxdp.api.field_table`): every field is listed; an honoured
one names a test that exercises it; a refused one with a value that would change the output is a 400 naming it,
and with its neutral value passes. The parsers are called directly; a few refusals go through the app with the
openai client (over httpx's ASGI transport, no server started)."""

from __future__ import annotations

import ast
import asyncio
import re
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_types
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_types
from prometheus_client import CollectorRegistry, Counter

from jaxdp.api.app import create_app
from jaxdp.api.common import ApiError
from jaxdp.api.context import bootstraps, pinned_rank
from jaxdp.api.field_table import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    MESSAGE,
    SAMPLING_PARAMS,
    TABLES,
    Field,
    Status,
    markdown,
)
from jaxdp.api.fields import check_fields
from jaxdp.api.native import _params as native_params
from jaxdp.api.openai_api import _params as openai_params
from jaxdp.api.openai_api import chat_prompt

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 512

# SGLang's native API, from its documentation ("Sampling Parameters", docs/basic_usage/sampling_params.md): the
# /generate arguments and the sampling parameters (core, penalizers, constrained decoding, other options), plus
# stream_interval, logit_bias and sampling_seed, which its SamplingParams class takes as well.
SGLANG_GENERATE = ["text", "input_ids", "input_embeds", "image_data", "audio_data", "sampling_params", "rid",
                   "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                   "return_text_in_logprobs", "stream", "lora_path", "custom_logit_processor", "return_hidden_states"]
SGLANG_SAMPLING = ["max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "json_schema",
                   "regex", "ebnf", "structural_tag", "n", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval", "logit_bias",
                   "sampling_seed"]


def typed_dict_keys(kind: type) -> set[str]:
    return set(kind.__required_keys__) | set(kind.__optional_keys__)


def openai_request_fields(module) -> set[str]:
    """Every field of an openai create-params module's request (streaming and not: `stream` is only there)."""
    return typed_dict_keys(module.CompletionCreateParamsStreaming) | typed_dict_keys(
        module.CompletionCreateParamsNonStreaming)


SCHEMAS = [
    ("/v1/chat/completions", CHAT, openai_request_fields(chat_types)),
    ("/v1/completions", COMPLETIONS, openai_request_fields(completion_types)),
    ("messages[]", MESSAGE, set().union(*(typed_dict_keys(k) for k in typing.get_args(ChatCompletionMessageParam)))),
    ("/generate", GENERATE, set(SGLANG_GENERATE)),
    ("sampling_params", SAMPLING_PARAMS, set(SGLANG_SAMPLING)),
]


@pytest.mark.parametrize(("table_name", "table", "schema"), SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_the_table_lists_every_field_of_the_schemas(table_name, table, schema):
    """A field the openai package (or SGLang's documentation) has and the table does not list fails here."""
    assert schema, table_name
    missing = sorted(schema - set(table))
    assert not missing, f"{table_name}: add these fields to jaxdp/api/field_table.py: {missing}"
    assert TABLES[table_name][0] is table


def all_fields() -> list[tuple[str, str, Field]]:
    return [(t, name, f) for t, (table, _) in TABLES.items() for name, f in sorted(table.items())]


# ---- honoured: a test exercises it ----------------------------------------------------------------------------


def source_of(ref: str) -> str:
    path, name = ref.split("::")
    tree = ast.parse((ROOT / path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment((ROOT / path).read_text(), node) or ""
    raise AssertionError(f"{ref} names no test")


@pytest.mark.parametrize(("table_name", "name", "f"), [x for x in all_fields() if x[2].status is Status.HONOURED],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_an_honoured_field_names_a_test_that_sends_it(table_name, name, f):
    assert re.fullmatch(r"tests/test_\w+\.py::test_\w+", f.where), (table_name, name, f.where)
    assert re.search(rf"\b{name}\b", source_of(f.where)), f"{f.where} does not send {name} ({table_name})"


# ---- refused: a 400 naming the field, unless neutral --------------------------------------------------------

# What a client that means it sends (the rest get a generic value no table counts as neutral).
MEANT: dict[str, list[Any]] = {
    "frequency_penalty": [0.5, -1], "presence_penalty": [1.2], "repetition_penalty": [1.1, 0.9],
    "logit_bias": [{"50256": -100}, {"7": 5}],
    "tools": [[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]],
    "tool_choice": ["required", {"type": "function", "function": {"name": "add"}}],
    "functions": [[{"name": "add", "parameters": {}}]], "function_call": [{"name": "add"}],
    "response_format": [{"type": "json_object"},
                        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}],
    "tool_calls": [[{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]],
    "best_of": [2], "suffix": ["tail"], "min_tokens": [3], "min_new_tokens": [3], "modalities": [["text", "audio"]],
    "skip_special_tokens": [False], "echo": [True], "add_generation_prompt": [False], "image_data": ["a.png"],
}


def meant_values(name: str, f: Field) -> list[Any]:
    values = MEANT.get(name, [1.5, "x"])
    assert not any(f.is_neutral(v) for v in values), name
    return values


REFUSED = [x for x in all_fields() if x[2].status is Status.REFUSED]


@pytest.mark.parametrize(("table_name", "name", "f"), REFUSED, ids=[f"{t}:{n}" for t, n, _ in REFUSED])
def test_a_refused_field_is_a_400_naming_it_and_its_neutral_value_passes(table_name, name, f):
    for value in meant_values(name, f):
        with pytest.raises(ApiError) as e:
            check_fields({name: value}, table_name, where="")
        message = e.value.message
        assert e.value.status == 400 and e.value.param == name
        assert message == f"{name} is not supported by this server yet; leave it out or send {f.where}"
    for value in (None, *f.neutral_values):
        assert check_fields({name: value}, table_name) == []


def test_neutral_means_the_json_value_itself():
    penalty, custom, tool_choice = CHAT["length_penalty"], SAMPLING_PARAMS["custom_params"], CHAT["tool_choice"]
    assert penalty.is_neutral(1) and penalty.is_neutral(1.0) and not penalty.is_neutral(True)
    assert custom.is_neutral({}) and not custom.is_neutral({"5": 0})
    assert tool_choice.status is Status.HONOURED and tool_choice.refusal is None  # (every value: a grammar forces)
    assert not CHAT["response_format"].is_neutral({"type": "text", "json_schema": {}})


@pytest.mark.parametrize(("table_name", "name", "f"), [x for x in all_fields() if x[2].status is Status.NO_EFFECT],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_a_field_without_effect_is_accepted(table_name, name, f):
    assert f.where and check_fields({name: "anything"}, table_name) == []


def test_unknown_fields_are_logged_at_the_top_and_refused_in_sampling_params():
    assert check_fields({"messages": [], "frobnicate": 1}, "/v1/chat/completions") == ["frobnicate"]
    assert check_fields({"text": "a", "model": "m"}, "/generate") == ["model"]
    with pytest.raises(ApiError, match=r"^sampling_params\.top_a is not a field this server knows"):
        check_fields({"temperature": 0, "top_a": 0.2}, "sampling_params", where="sampling_params.")


def test_docs_carry_the_table():
    assert markdown() in (ROOT / "docs" / "api.md").read_text(), "regenerate docs/api.md's table from markdown()"


# ---- the parsers: what an honoured field becomes -----------------------------------------------------------


def test_openai_sampling_fields_reach_the_sampling_params():
    ctx = SimpleNamespace(vocab_size=VOCAB)
    body = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 11,
            "stop": ["##"], "stop_token_ids": [3], "ignore_eos": True}
    p = openai_params(ctx, body, 16)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (7, 0.5, 0.9, 5, 0.1, 11)
    assert p.stop == ["##"] and p.stop_token_ids == [3] and p.ignore_eos is True
    assert openai_params(ctx, {"max_completion_tokens": 9}, None).max_new_tokens == 9
    assert openai_params(ctx, {"max_tokens": 4, "max_completion_tokens": 9}, None).max_new_tokens == 4
    assert openai_params(ctx, {}, 16).max_new_tokens == 16
    assert openai_params(ctx, {"include_stop_str_in_output": True}, 16).no_stop_trim is True  # (vLLM's name)
    assert openai_params(ctx, {"no_stop_trim": True}, 16).no_stop_trim is True


def test_native_sampling_fields_reach_the_sampling_params():
    ctx = SimpleNamespace(vocab_size=VOCAB, warned=set())
    sp = {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 11,
          "stop": "##", "stop_token_ids": [3], "ignore_eos": True, "n": 2, "skip_special_tokens": False,
          "frequency_penalty": 0, "stream_interval": 4}
    (p,), n, skip = native_params(ctx, {"sampling_params": sp}, 1)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (7, 0.5, 0.9, 5, 0.1, 11)
    assert p.stop == ["##"] and p.stop_token_ids == [3] and p.ignore_eos is True and n == 2 and skip is False
    (p,), _, _ = native_params(ctx, {"sampling_params": {"stop_regex": r"\d+\.", "no_stop_trim": True}}, 1)
    assert p.stop_regex == [r"\d+\."] and p.no_stop_trim is True
    with pytest.raises(ApiError, match=r"^sampling_params\.stop_regex '\(a\)\\\\1' is not a regular expression this "
                                       r"server reads \(invalid escape sequence"):
        native_params(ctx, {"sampling_params": {"stop_regex": [r"(a)\1"]}}, 1)
    (p,), _, _ = native_params(ctx, {"sampling_params": {"sampling_seed": 5}}, 1)  # SGLang's name of seed
    assert p.seed == 5
    with pytest.raises(ApiError, match="seed and sampling_params.sampling_seed differ"):
        native_params(ctx, {"sampling_params": {"seed": 4, "sampling_seed": 5}}, 1)
    with pytest.raises(ApiError, match=r"^sampling_params\.custom_params is not supported"):
        native_params(ctx, {"sampling_params": [{}, {"custom_params": {"a": 1}}]}, 2)


def test_rank_pins_and_bootstrap_fields_are_read():
    ctx = SimpleNamespace(backend=SimpleNamespace(num_ranks=8), warned=set())
    http = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(ctx=ctx)), headers={})
    assert pinned_rank({"routed_dp_rank": 5}, http) == 5
    assert pinned_rank({"data_parallel_rank": 2}, http) == 2 and "data_parallel_rank" in ctx.warned
    (b,) = bootstraps({"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998, "bootstrap_room": 77,
                       "disagg_prefill_dp_rank": 3}, 1)
    assert (b.host, b.port, b.room, b.prefill_dp_rank) == ("10.0.0.2", 8998, 77, 3)


class TemplateCtx(SimpleNamespace):
    """What chat_prompt needs of the server: the messages it would hand the chat template."""

    async def encode_chat(self, messages, rank, **template):
        self.rendered = messages
        return [1, 2, 3]


def test_messages_carry_role_content_and_name_to_the_template():
    ctx = TemplateCtx(warned=set())
    messages = [{"role": "system", "content": "be brief", "name": "ops"},
                {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]},
                {"role": "assistant", "content": "2", "tool_calls": []}]
    assert asyncio.run(chat_prompt(ctx, messages, None)) == [1, 2, 3]
    assert ctx.rendered == [{"role": "system", "content": "be brief", "name": "ops"},
                            {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    for bad, says in (([{"role": "function", "name": "add", "content": "3"}], "messages[0] has role 'function'"),
                      ([{"role": "user", "content": None}], "a message's content must be a string"),
                      ([{"role": "user", "content": "x", "name": 5}], "messages[0].name must be a string")):
        with pytest.raises(ApiError) as e:
            asyncio.run(chat_prompt(ctx, bad, None))
        assert e.value.message.startswith(says) and "\n" not in e.value.message


# ---- through the app, with the openai client ---------------------------------------------------------------


def app_without_engine():
    """The real app over a backend that never runs a request: every request here is refused before it is made."""
    backend = SimpleNamespace(tokenizer=None, num_ranks=8, model_cfg=SimpleNamespace(vocab_size=VOCAB),
                              context_len=lambda rank: 64)
    metrics = SimpleNamespace(http_errors=Counter("http_errors", "", ["status"], registry=CollectorRegistry()))
    return create_app(backend, metrics=metrics)


async def refusals() -> list[str]:
    transport = httpx.ASGITransport(app=app_without_engine())
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:30000") as http:
        client = openai.AsyncOpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none", http_client=http,
                                    max_retries=0)
        messages = [{"role": "user", "content": "1+1="}]
        tools = MEANT["tools"][0]
        calls = [
            client.chat.completions.create(model="default", messages=messages, frequency_penalty=5),
            client.chat.completions.create(model="default", messages=messages, tools=tools, tool_choice="required"),
            client.chat.completions.create(model="default", messages=messages,
                                           response_format=MEANT["response_format"][1]),
            client.completions.create(model="default", prompt="1+1=", logit_bias={"7": 500}),
            client.completions.create(model="default", prompt="1+1=", extra_body={"repetition_penalty": 3}),
        ]
        said = []
        for call in calls:
            with pytest.raises(openai.BadRequestError) as e:
                await call
            said.append(e.value.body["message"])
        answer = await http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"presence_penalty": 9}})
        assert answer.status_code == 400
        said.append(answer.json()["error"]["message"])
        return said


def test_the_openai_client_gets_a_400_naming_the_field():
    said = asyncio.run(refusals())
    assert [s.split(" ")[0] for s in said] == ["frequency_penalty", "tool_choice", "response_format", "logit_bias",
                                               "repetition_penalty", "presence_penalty"]
    assert all(" must be numbers in " in s or " must be a number in " in s for s in [said[0], *said[3:]])  # (honoured)
    for s in said[1:3]:  # (honoured: this app has no grammar backend, as a server with --grammar-backend none)
        assert s.split(" ", 1)[1].startswith("needs constrained decoding, and this server serves no grammars "
                                             "(--grammar-backend none"), s
