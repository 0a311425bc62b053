"""Issue 46 points 3 and 4, the server half: tools and reasoning through /v1/chat/completions, with the real openai
client against the app in process (httpx's ASGI transport, no server started).

The embedded default model does not write tool calls, so the engines are a stand-in (`CannedEngines`) whose
requests answer a fixed text, token by token, ended by the stop token: everything from the request body to the
response (chat template, parsers, streaming, finish reasons) is the product's. The tokenizer is the default model's
byte tokenizer with DeepSeek's tool-call markers added as special tokens (as they are in DeepSeek's vocabulary), and
a chat template written in DeepSeek-V3's style that renders tools, assistant tool calls and tool results.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter

from jaxdp.api.app import create_app
from jaxdp.api.context import ChatParsing
from jaxdp.api.parsers.tool_formats import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP
from jaxdp.engine.sched.request import Request, State
from jaxdp.model.loader import default_model_path
from jaxdp.serve import build_parser
from jaxdp.serve_config import UserError, serve_config
from jaxdp.tokenizer import BOS, EOS, PAD, Tokenizer, build_byte_tokenizer

TOOL_OUTPUTS_BEGIN, TOOL_OUTPUT_BEGIN = "<｜tool▁outputs▁begin｜>", "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END, TOOL_OUTPUTS_END = "<｜tool▁output▁end｜>", "<｜tool▁outputs▁end｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
MARKERS = [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, TOOL_OUTPUTS_BEGIN, TOOL_OUTPUT_BEGIN,
           TOOL_OUTPUT_END, TOOL_OUTPUTS_END, USER, ASSISTANT]

# DeepSeek-V3's way of writing a conversation with tools (its markers, its ```json fences around the arguments, the
# arguments joined to strings with `+` as its template does), plus `thinking` (DeepSeek-V3.1's template keyword).
DEEPSEEK_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}## Tools\n{% for tool in tools %}### {{ tool.function.name }}\n"
    "Parameters: {{ tool.function.parameters | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{{ message.content }}"
    "{% elif message.role == 'user' %}" + USER + "{{ message.content }}"
    "{% elif message.role == 'assistant' and message.tool_calls %}" + ASSISTANT + "{{ message.content }}"
    + DS_CALLS_BEGIN + "{% for call in message.tool_calls %}"
    "{{ '" + DS_CALL_BEGIN + "' + call.type + '" + DS_SEP + "' + call.function.name + '\\n```json\\n' "
    "+ call.function.arguments + '\\n```" + DS_CALL_END + "' }}"
    "{% endfor %}" + DS_CALLS_END + "{{ eos_token }}"
    "{% elif message.role == 'assistant' %}" + ASSISTANT + "{{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}" + TOOL_OUTPUTS_BEGIN + TOOL_OUTPUT_BEGIN
    + "{{ message.tool_call_id }}: {{ message.content }}" + TOOL_OUTPUT_END + TOOL_OUTPUTS_END +
    "{% else %}{{ raise_exception('unknown role ' ~ message.role) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% if thinking %}<think>{% endif %}{% endif %}"
)

# GLM-4.5's way: the arguments of a past call iterated as an object (a JSON string cannot be).
GLM_STYLE_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }}"
    "{% for key, value in call.function.arguments.items() %}<arg_key>{{ key }}</arg_key>"
    "<arg_value>{{ value | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% endfor %}<|assistant|>"
)

ADD = {"type": "function", "function": {"name": "add", "description": "a + b",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def deepseek_call(name: str, arguments: dict) -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{json.dumps(arguments)}\n```{DS_CALL_END}"


TEXT_THEN_CALL = f"Let me add them. {DS_CALLS_BEGIN}{deepseek_call('add', {'a': 37, 'b': 48})}{DS_CALLS_END}"
TWO_CALLS = (f"{DS_CALLS_BEGIN}{deepseek_call('add', {'a': 1, 'b': 2})}\n"
             f"{deepseek_call('weather', {'city': 'Zürich'})}{DS_CALLS_END}")


def tokenizer_dir(path: Path, template: str) -> Path:
    """A checkpoint's tokenizer files: the byte tokenizer, DeepSeek's markers as special tokens, `template`."""
    tok = build_byte_tokenizer()
    tok.add_special_tokens(MARKERS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


class CannedEngines:
    """A stand-in for the server's engines (`ReplicaSet`'s interface as the API uses it): request k answers
    outputs[k] (the last one again once they run out), `step` tokens per update, then the stop token."""

    num_ranks = 1

    def __init__(self, tokenizer: Tokenizer, outputs: list[str], step: int = 1):
        self.tokenizer, self.outputs, self.step = tokenizer, outputs, step
        self.model_cfg = SimpleNamespace(vocab_size=tokenizer.vocab_size)
        self.prompts: list[list[int]] = []
        self.answers: dict[str, list[int]] = {}

    def context_len(self, rank: int | None = None) -> int:
        return 8192

    def make_request(self, prompt_ids, params, *, rid=None, rank=None, bootstrap=None) -> Request:
        k = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        rid = rid or f"canned-{k}"
        text = self.outputs[min(k, len(self.outputs) - 1)]
        self.answers[rid] = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Request(rid, list(prompt_ids), params)

    async def stream(self, req: Request):
        ids = self.answers[req.rid]
        for end in range(self.step, len(ids) + self.step, self.step):
            req.output_ids = ids[:end]
            if end >= len(ids):
                req.state, req.finish_reason = State.FINISHED, "stop"
            yield req
            await asyncio.sleep(0)

    def discard(self, req: Request) -> None:
        pass

    def abort(self, rid: str) -> None:
        pass

    def prompt_text(self, k: int = -1) -> str:
        return self.tokenizer.decode(self.prompts[k], skip_special_tokens=False)


def app_over(engines: CannedEngines, parsing: ChatParsing):
    metrics = SimpleNamespace(http_errors=Counter("http_errors", "", ["status"], registry=CollectorRegistry()))
    return create_app(engines, tokenizer=engines.tokenizer, metrics=metrics, parsing=parsing)


def with_client(app, calls: Callable[[openai.AsyncOpenAI], Awaitable[Any]]) -> Any:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:30000") as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none", http_client=http,
                                        max_retries=0)
            return await calls(client)

    return asyncio.run(main())


async def streamed(client: openai.AsyncOpenAI, **request) -> dict[str, Any]:
    """A streamed answer as a client assembles it: content and reasoning joined, each call's arguments joined (its
    id and name from its first piece, which must come before its arguments), the last finish_reason."""
    content, reasoning, calls, finish = [], [], {}, None
    async for chunk in await client.chat.completions.create(model="default", stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            for piece in delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.function.name and piece.type == "function", piece
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None, piece
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": "".join(content), "reasoning_content": "".join(reasoning), "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}


def whole(answer) -> dict[str, Any]:
    """A non-streamed answer in the same shape as `streamed`'s."""
    message = answer.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in message.tool_calls or []]
    return {"content": message.content or "", "reasoning_content": getattr(message, "reasoning_content", None) or "",
            "finish": answer.choices[0].finish_reason, "calls": calls}


def without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    """Call ids are drawn afresh for each answer (OpenAI's `call_` and 24 hex digits): compared apart."""
    for call in answer["calls"]:
        assert call["id"].startswith("call_") and len(call["id"]) == 29, call
    return answer | {"calls": [{k: v for k, v in c.items() if k != "id"} for c in answer["calls"]]}


@pytest.fixture(scope="module")
def deepseek_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(tokenizer_dir(tmp_path_factory.mktemp("deepseek-style"), DEEPSEEK_STYLE_TEMPLATE))


MESSAGES = [{"role": "user", "content": "37+48="}]


def test_a_tool_call_streamed_and_not_with_the_text_before_it(deepseek_tokenizer):
    """--tool-call-parser deepseekv3, tools in the request: the call is message.tool_calls (an id, the name, the
    arguments as written), finish_reason "tool_calls", the text before it content; streamed at any token split,
    the delta.tool_calls assemble to exactly the same call. The markers are special tokens: read only because a
    request with tools keeps them in the text. Without the parser, or with tool_choice "none", it is all content."""
    for step in (1, 3):
        engines = CannedEngines(deepseek_tokenizer, [TEXT_THEN_CALL], step=step)
        app = app_over(engines, ChatParsing(tool_call_parser="deepseekv3"))

        async def calls(client):
            answer = await client.chat.completions.create(model="default", messages=MESSAGES, tools=[ADD],
                                                          tool_choice="auto")
            return answer, await streamed(client, messages=MESSAGES, tools=[ADD])

        answer, stream = with_client(app, calls)
        message = answer.choices[0].message
        assert message.content == "Let me add them." and answer.choices[0].finish_reason == "tool_calls"
        (call,) = message.tool_calls
        assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"a": 37, "b": 48}
        assert without_ids(stream) == without_ids(whole(answer))
        assert "## Tools\n### add\nParameters: " + json.dumps(ADD["function"]["parameters"]) in engines.prompt_text()

    # no parser: the template still gets the tools, the output is the text as written, markers and all (SGLang's);
    # tool_choice "none": the template is not told of the tools, nothing is read as a call, special tokens skipped
    without_markers = TEXT_THEN_CALL
    for marker in MARKERS:
        without_markers = without_markers.replace(marker, "")
    for parsing, request, content, tools_shown in (
            (ChatParsing(), {"tools": [ADD]}, TEXT_THEN_CALL, True),
            (ChatParsing(tool_call_parser="deepseekv3"), {"tools": [ADD], "tool_choice": "none"}, without_markers,
             False)):
        engines = CannedEngines(deepseek_tokenizer, [TEXT_THEN_CALL])

        async def plain(client, request=request):
            answer = await client.chat.completions.create(model="default", messages=MESSAGES, **request)
            return whole(answer), await streamed(client, messages=MESSAGES, **request)

        answer, stream = with_client(app_over(engines, parsing), plain)
        assert answer == stream == {"content": content, "reasoning_content": "", "finish": "stop", "calls": []}
        assert ("## Tools" in engines.prompt_text()) is tools_shown


def test_parallel_tool_calls_false_keeps_the_first_call(deepseek_tokenizer):
    engines = CannedEngines(deepseek_tokenizer, [TWO_CALLS], step=2)
    app = app_over(engines, ChatParsing(tool_call_parser="deepseekv3"))

    async def calls(client):
        both = await client.chat.completions.create(model="default", messages=MESSAGES, tools=[ADD, WEATHER])
        first = await client.chat.completions.create(model="default", messages=MESSAGES, tools=[ADD, WEATHER],
                                                     parallel_tool_calls=False)
        return whole(both), whole(first), await streamed(client, messages=MESSAGES, tools=[ADD, WEATHER],
                                                         parallel_tool_calls=False)

    both, first, stream = with_client(app, calls)
    assert [(c["name"], json.loads(c["arguments"])) for c in both["calls"]] == [
        ("add", {"a": 1, "b": 2}), ("weather", {"city": "Zürich"})]
    assert without_ids(first) == without_ids(stream) == {
        "content": "", "reasoning_content": "", "finish": "tool_calls", "calls": without_ids(both)["calls"][:1]}


def test_reasoning_content_streamed_and_not(deepseek_tokenizer):
    """--reasoning-parser: reasoning_content in message and in stream deltas, the same text either way;
    separate_reasoning false leaves it in the content. deepseek-v3 starts inside the reasoning only when
    chat_template_kwargs turns `thinking` on (the template then opens <think> in the prompt, as DeepSeek-V3.1's
    does); with a tool-call parser too, a call after the reasoning is read as well."""
    r1 = "<think>\nThe units: 7+8=15, carry 1.\n</think>\n\n85"
    engines = CannedEngines(deepseek_tokenizer, [r1], step=2)
    app = app_over(engines, ChatParsing(reasoning_parser="deepseek-r1"))

    async def calls(client):
        answer = await client.chat.completions.create(model="default", messages=MESSAGES)
        kept = await client.chat.completions.create(model="default", messages=MESSAGES,
                                                    extra_body={"separate_reasoning": False})
        return whole(answer), await streamed(client, messages=MESSAGES), whole(kept)

    answer, stream, kept = with_client(app, calls)
    assert answer == stream == {"content": "85", "reasoning_content": "The units: 7+8=15, carry 1.", "finish": "stop",
                                "calls": []}
    assert kept["content"] == r1 and kept["reasoning_content"] == ""

    v31 = "Add the tens, then the units.</think>85"
    engines = CannedEngines(deepseek_tokenizer, [v31])
    app = app_over(engines, ChatParsing(reasoning_parser="deepseek-v3"))

    async def thinking(client):
        on = {"chat_template_kwargs": {"thinking": True}}
        answer = await client.chat.completions.create(model="default", messages=MESSAGES, extra_body=on)
        prompt_on = engines.prompt_text()
        off = await client.chat.completions.create(model="default", messages=MESSAGES)
        return whole(answer), await streamed(client, messages=MESSAGES, extra_body=on), prompt_on, whole(off)

    answer, stream, prompt_on, off = with_client(app, thinking)
    assert answer == stream and answer["reasoning_content"] == "Add the tens, then the units."
    assert answer["content"] == "85" and prompt_on.endswith(ASSISTANT + "<think>")
    assert off["content"] == v31 and off["reasoning_content"] == "" and engines.prompt_text(1).endswith(ASSISTANT)

    both = f"<think>add them</think>{DS_CALLS_BEGIN}{deepseek_call('add', {'a': 37, 'b': 48})}{DS_CALLS_END}"
    engines = CannedEngines(deepseek_tokenizer, [both])
    app = app_over(engines, ChatParsing(tool_call_parser="deepseekv3", reasoning_parser="deepseek-r1"))

    async def reasoning_then_call(client):
        answer = await client.chat.completions.create(model="default", messages=MESSAGES, tools=[ADD])
        return whole(answer), await streamed(client, messages=MESSAGES, tools=[ADD])

    answer, stream = with_client(app, reasoning_then_call)
    assert without_ids(answer) == without_ids(stream) == {
        "content": "", "reasoning_content": "add them", "finish": "tool_calls",
        "calls": [{"name": "add", "arguments": '{"a": 37, "b": 48}'}]}


def test_a_two_turn_tool_conversation_reaches_the_template(deepseek_tokenizer, tmp_path):
    """The second turn of a tool conversation: the assistant's tool_calls (content null) and the tool's result
    (tool_call_id) reach the checkpoint's chat template as transformers hands them over, with the tools and
    chat_template_kwargs; the answer is the model's text. A template that iterates past arguments as an object
    (GLM's) gets them as one."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 37, "b": 48}'}}
    conversation = [{"role": "user", "content": "37+48="}, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "85"}]
    engines = CannedEngines(deepseek_tokenizer, ["37+48 is 85."])
    app = app_over(engines, ChatParsing(tool_call_parser="deepseekv3"))

    async def calls(client):
        return await client.chat.completions.create(model="default", messages=conversation, tools=[ADD],
                                                    extra_body={"chat_template_kwargs": {"thinking": True}})

    answer = with_client(app, calls)
    assert answer.choices[0].message.content == "37+48 is 85." and answer.choices[0].message.tool_calls is None
    expected = (f"{BOS}## Tools\n### add\nParameters: {json.dumps(ADD['function']['parameters'])}\n"
                f"{USER}37+48={ASSISTANT}{DS_CALLS_BEGIN}{deepseek_call('add', {'a': 37, 'b': 48})}{DS_CALLS_END}"
                f"{EOS}{TOOL_OUTPUTS_BEGIN}{TOOL_OUTPUT_BEGIN}call_1: 85{TOOL_OUTPUT_END}{TOOL_OUTPUTS_END}"
                f"{ASSISTANT}<think>")
    assert engines.prompt_text() == expected

    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(deepseek_tokenizer.dir))
    handed = [conversation[0], conversation[1] | {"content": ""}, conversation[2]]  # (content null: "", as SGLang)
    assert hf.apply_chat_template(handed, tools=[ADD], tokenize=False, add_generation_prompt=True,
                                  thinking=True) == expected

    glm = Tokenizer(tokenizer_dir(tmp_path / "glm-style", GLM_STYLE_TEMPLATE))
    engines = CannedEngines(glm, ["85"])
    with_client(app_over(engines, ChatParsing()), lambda client: client.chat.completions.create(
        model="default", messages=conversation))
    assert engines.prompt_text() == (f"{BOS}<|user|>37+48=<|assistant|><tool_call>add<arg_key>a</arg_key><arg_value>37"
                                     "</arg_value><arg_key>b</arg_key><arg_value>48</arg_value></tool_call>"
                                     "<|tool|>85<|assistant|>")


HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()


@pytest.mark.skipif(not HAVE_DEFAULT, reason="needs the embedded default model's tokenizer")
def test_the_default_models_template_given_tools(tmp_path):
    """The default model's template takes tools (docs/api.md): one line per tool in a system turn, an assistant's
    calls as the JSON array a forced call writes, a tool result as a system turn; without tools the prompt is the one
    the model was trained on."""
    tokenizer = Tokenizer(default_model_path())
    engines = CannedEngines(tokenizer, ["85"])
    app = app_over(engines, ChatParsing())
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 37, "b": 48}'}}

    async def calls(client):
        await client.chat.completions.create(model="default", messages=MESSAGES)
        await client.chat.completions.create(model="default", messages=MESSAGES, tools=[ADD])
        await client.chat.completions.create(model="default", tools=[ADD], messages=[
            *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "85"}])

    with_client(app, calls)
    tools_line = '<|system|>Tools:\nadd{"a":{"type":"integer"},"b":{"type":"integer"}} a + b'
    assert [engines.prompt_text(k) for k in range(3)] == [
        "<bos><|user|>37+48=<|assistant|>",
        f"<bos>{tools_line}<|user|>37+48=<|assistant|>",
        f'<bos>{tools_line}<|user|>37+48=<|assistant|>[{{"name":"add","parameters":{{"a": 37, "b": 48}}}}]<eos>'
        "<|system|>Tool result: 85<|assistant|>"]


def test_forced_tool_choice_without_a_grammar_backend_and_bad_tool_fields_are_refused(deepseek_tokenizer):
    """tool_choice "required" or a named function needs constrained decoding (a grammar): on a server without a
    grammar backend (this app has none) a 400 saying so; so are the other malformed tool fields. (With a backend:
    tests/test_structured_outputs.py.)"""
    app = app_over(CannedEngines(deepseek_tokenizer, ["85"]), ChatParsing(tool_call_parser="deepseekv3"))
    named = {"type": "function", "function": {"name": "add"}}
    grammar = "tool_choice needs constrained decoding, and this server serves no grammars (--grammar-backend none"
    cases = [
        ({"tools": [ADD], "tool_choice": "required"}, grammar),
        ({"tools": [ADD], "tool_choice": named}, grammar),
        ({"tool_choice": "required"}, "tool_choice required needs tools; send the tools the model may call"),
        ({"tools": [ADD], "tool_choice": "sometimes"}, 'tool_choice must be "auto", "none", "required" or {"type": '
                                                       '"function", "function": {"name": ...}}, got \'sometimes\''),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0] must be {"),
        ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs.tools is an argument"),
        ({"messages": [{"role": "function", "name": "add", "content": "85"}]}, "messages[0] has role 'function'"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "add"}}]}]},
         "messages[0].tool_calls belongs to an assistant message"),
    ]

    async def calls(client):
        said = []
        for request, _ in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="default", **({"messages": MESSAGES} | request))
            said.append(e.value.body["message"])
        return said

    for said, (_, expected) in zip(with_client(app, calls), cases, strict=True):
        assert said.startswith(expected) and "\n" not in said, said


def test_the_parser_flags_reach_the_config_and_an_unknown_name_is_one_sentence():
    config = serve_config(build_parser().parse_args(["--model-path", "tiny", "--tool-call-parser", "glm47",
                                                     "--reasoning-parser", "glm45"]))
    assert (config.tool_call_parser, config.reasoning_parser) == ("glm47", "glm45")
    assert serve_config(build_parser().parse_args(["--model-path", "tiny"])).tool_call_parser is None
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(UserError) as e:
            serve_config(build_parser().parse_args(["--model-path", "tiny", flag, "deepseek_v3"]))
        assert str(e.value).startswith(f"{flag} 'deepseek_v3' is not one jaxdp knows: use one of ")
