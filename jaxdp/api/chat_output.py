"""A chat request's output as OpenAI's message fields: the request fields that shape the prompt and the reading
(`tools`, `tool_choice`, `parallel_tool_calls`, `separate_reasoning`, `chat_template_kwargs`) in `ChatOutput`, and
`ChoiceReader`, which reads one choice's text, one delta at a time, for a stream and for a whole answer alike: the
reasoning split off first (`--reasoning-parser`), then tool calls read from the rest (`--tool-call-parser`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdp.api.common import ApiError
from jaxdp.api.context import ServerContext
from jaxdp.api.fields import field
from jaxdp.api.parsers import ReasoningParser, ToolCallDelta, ToolCallParser, reasoning_parser, tool_call_parser
from jaxdp.api.parsers.forced_calls import ToolCallArrayReader
from jaxdp.api.structured import tool_calls_schema
from jaxdp.tokenizer import TEMPLATE_ARGUMENTS


def _tools(body: dict) -> list[dict[str, Any]] | None:
    """The request's tools, checked (None when there are none)."""
    tools = field(body, "tools", list)
    for k, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]
                or not isinstance(function.get("parameters", {}), dict | None)):
            raise ApiError(f'tools[{k}] must be {{"type": "function", "function": {{"name": ..., "description": ..., '
                           '"parameters": {...}}}}', param="tools")
    return tools or None


def _template_kwargs(body: dict) -> dict[str, Any]:
    """chat_template_kwargs: keyword arguments for the chat template, none of which replaces what it is given."""
    kwargs = field(body, "chat_template_kwargs", dict, {})
    clash = sorted(TEMPLATE_ARGUMENTS & kwargs.keys())
    if clash:
        raise ApiError(f"chat_template_kwargs.{clash[0]} is an argument the chat template gets already; send it at "
                       "the top of the request (messages, tools, ...) instead", param="chat_template_kwargs")
    return kwargs


# A reasoning format whose template opens the reasoning in the prompt when a template keyword argument is true
# (DeepSeek-V3.1's `thinking`, as SGLang reads it): the output then starts inside the reasoning.
OPENED_BY_TEMPLATE_KWARG = {"deepseek-v3": "thinking"}


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    """What a chat request makes of its output text: the tools it hands the template, whether their calls are read
    out of the text (`--tool-call-parser`, tools, tool_choice not "none"), how many, and whether the reasoning is
    split off (`--reasoning-parser`, separate_reasoning). With tool_choice "required" or a named function the answer
    is forced: `forced_calls` is the grammar's JSON Schema (a JSON array of calls), read by ToolCallArrayReader."""

    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    tool_call_parser: str | None
    reasoning_parser: str | None
    first_call_only: bool
    forced_calls: dict[str, Any] | None = None

    def reader(self) -> ChoiceReader:
        """A reader for one choice's output."""
        reasoning = None
        if self.reasoning_parser is not None:
            kwarg = OPENED_BY_TEMPLATE_KWARG.get(self.reasoning_parser)
            opened = True if kwarg is not None and self.template_kwargs.get(kwarg) is True else None
            reasoning = reasoning_parser(self.reasoning_parser, starts_open=opened)
        if self.forced_calls is not None:
            return ChoiceReader(None, ToolCallArrayReader(), self.first_call_only)  # (the grammar has no reasoning)
        tools = None if self.tool_call_parser is None else tool_call_parser(self.tool_call_parser, tools=self.tools)
        return ChoiceReader(reasoning, tools, self.first_call_only)


def chat_output(ctx: ServerContext, body: dict) -> ChatOutput:
    """The chat fields that shape the prompt and the reading of the output."""
    tools = _tools(body)
    choice = body.get("tool_choice")
    named = isinstance(choice, dict)
    if choice is not None and choice not in ("auto", "none", "required") and not named:
        raise ApiError(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
                       f'{{"name": ...}}}}, got {str(choice)[:40]!r}', param="tool_choice")
    if choice == "none":
        tools = None  # (SGLang's: the template is not told of them, and nothing is read as a call)
    parallel = field(body, "parallel_tool_calls", bool, True)
    separate = field(body, "separate_reasoning", bool, True)
    forced = None
    if choice == "required" or named:
        if not tools:
            raise ApiError(f"tool_choice {'naming a function' if named else 'required'} needs tools; send the "
                           "tools the model may call", param="tool_choice")
        forced = tool_calls_schema(tools, choice, parallel)
    parsing = ctx.parsing
    return ChatOutput(tools, _template_kwargs(body), parsing.tool_call_parser if tools else None,
                      parsing.reasoning_parser if separate else None, not parallel, forced)


class ChoiceReader:
    """One chat choice's output text as OpenAI's message fields, one delta at a time: the reasoning split off
    first, then tool calls read from the rest, the remaining text content. `read` returns a delta's fields
    (`reasoning_content`, `content`, `tool_calls` with at most one entry per call); a whole answer is one read with
    `final`, so a stream's deltas assembled equal it. With neither parser a delta is all content."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | ToolCallArrayReader | None,
                 first_call_only: bool):
        self.reasoning, self.tools, self.first_call_only = reasoning, tools, first_call_only
        self.reads_reasoning = reasoning is not None
        self.calls = 0  # tool calls read so far
        self._done = False

    def read(self, delta: str, final: bool) -> dict[str, Any]:
        if self._done:
            return {}
        self._done = final
        thought, text = "", delta
        if self.reasoning is not None:
            split = self.reasoning.feed(delta)
            thought, text = split.reasoning_content, split.content
            if final:
                rest = self.reasoning.finish()
                thought, text = thought + rest.reasoning_content, text + rest.content
        out: dict[str, Any] = {}
        if thought:
            out["reasoning_content"] = thought
        if self.tools is None:
            if text:
                out["content"] = text
            return out
        pieces = self.tools.feed(text) + (self.tools.finish() if final else [])
        content = "".join(p for p in pieces if isinstance(p, str))
        if content:
            out["content"] = content
        calls: dict[int, dict[str, Any]] = {}
        for piece in pieces:
            if not isinstance(piece, ToolCallDelta) or (self.first_call_only and piece.index > 0):
                continue
            if piece.name is not None:
                self.calls += 1
            if piece.index in calls:
                calls[piece.index]["function"]["arguments"] += piece.arguments
            else:
                calls[piece.index] = piece.to_openai()
        if calls:
            out["tool_calls"] = list(calls.values())
        return out


def chat_message(reader: ChoiceReader, text: str) -> dict[str, Any]:
    """A whole answer's `message`: content ("" when empty; null beside tool calls), reasoning_content (with a
    reasoning parser: null when empty), tool_calls (when the text held calls)."""
    fields = reader.read(text, final=True)
    calls = [{k: v for k, v in call.items() if k != "index"} for call in fields.get("tool_calls", [])]
    message: dict[str, Any] = {"role": "assistant", "content": fields.get("content") or (None if calls else "")}
    if reader.reads_reasoning:
        message["reasoning_content"] = fields.get("reasoning_content") or None
    if calls:
        message["tool_calls"] = calls
    return message
