"""Tool calls in a model's text: one parser for every format in `tool_formats`, streamed or not.

A format is data (`ToolCallFormat`, in `tool_formats` with the formats themselves): the markers around the calls,
how a call's header names the function, and how its arguments are written (a JSON object, or key/value tags turned
into one). `ToolCallParser` reads any of them with one state machine, fed text deltas of any size; `parse` is the
same machine fed the whole text at once, so a stream assembled with `assemble_tool_calls` is exactly the one-shot
result.

The rules, the same streamed and not:
- text outside calls is content; blank space right before a call is dropped, and right after one unless it
  separates content on both sides (the peers strip the content around calls);
- a call counts once its header (the begin marker up to the function's name) parses: its index, id and name go out
  then, its arguments follow in fragments as they arrive;
- a header that does not parse (no name, a name with spaces, a marker missing) leaves the call's text as content,
  markers and all, the way SGLang's and vLLM's parsers keep a call they cannot parse; a section marker (DeepSeek's
  and Kimi's `...calls begin` / `...calls end`) is dropped only around calls that parsed;
- JSON arguments are passed on as the model wrote them (vLLM's DeepSeek and Kimi parsers do the same): a call cut off
  before its end marker (max_tokens) ends with the arguments it has, as OpenAI's API does with finish_reason
  "length"; key/value arguments (GLM, DeepSeek V3.2's DSML) are turned into a JSON object one complete pair at a
  time, a pair cut off is left out.
"""

import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jaxdp.api.parsers.markers import find_first, partial_suffix_len
from jaxdp.api.parsers.tool_formats import ToolCallFormat

# the longest a call's header (or an argument's key tag) may run before the call is taken for text
MAX_HEADER_CHARS = 256
_SPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's `tool_calls[i]` (`arguments` is the JSON text of the arguments)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of OpenAI's streamed `delta.tool_calls`: a call's first piece carries its id and name, the next
    ones fragments of its arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedToolCalls:
    """A whole output split: the content (text outside calls) and the calls in order."""

    content: str
    calls: tuple[ToolCall, ...]


# what a feed returns, in output order: content text, or a piece of a call
StreamPiece = str | ToolCallDelta


def assemble_tool_calls(pieces: Iterable[StreamPiece]) -> ParsedToolCalls:
    """What a client builds from the streamed pieces: the content joined, each call's arguments joined."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    heads: dict[int, tuple[str, str]] = {}
    for piece in pieces:
        if isinstance(piece, str):
            content.append(piece)
            continue
        if piece.name is not None:
            heads[piece.index] = (piece.id or "", piece.name)
        calls.setdefault(piece.index, []).append(piece.arguments)
    return ParsedToolCalls("".join(content), tuple(
        ToolCall(heads[index][0], heads[index][1], "".join(calls[index])) for index in sorted(calls)))


def string_arguments(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, frozenset[str]]:
    """Per function of an OpenAI `tools` list, the arguments its schema types as strings only: the key/value
    formats write a string's value bare, so `007` stays "007" for these and is read as JSON for the others."""
    found: dict[str, frozenset[str]] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        names = set()
        for key, schema in properties.items():
            kind = schema.get("type") if isinstance(schema, Mapping) else None
            if kind == "string" or (isinstance(kind, list) and [k for k in kind if k != "null"] == ["string"]):
                names.add(key)
        if isinstance(function.get("name"), str):
            found[function["name"]] = frozenset(names)
    return found


def random_call_id(index: int) -> str:
    """A call id as OpenAI writes them (`call_` and 24 hex digits), unique across turns."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _json_value(text: str, is_string: bool) -> str:
    if not is_string:
        try:
            return json.dumps(json.loads(text), ensure_ascii=False)
        except ValueError:
            pass
    return json.dumps(text, ensure_ascii=False)


_CONTENT, _OPENING, _HEADER, _JSON, _PAIRS, _PAIR_HEAD, _PAIR_VALUE, _SECTION = range(8)


class ToolCallParser:
    """Reads one output's tool calls in one format: `feed` each text delta, then `finish` once; or `parse` a whole
    text. `tools` (OpenAI's list) tells the key/value formats which arguments are strings; `make_call_id(index)`
    names the calls of formats whose model does not (Kimi's does)."""

    def __init__(self, fmt: ToolCallFormat, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 make_call_id: Callable[[int], str] = random_call_id):
        self.format = fmt
        self._tools = tools
        self._string_arguments = string_arguments(tools)
        self._make_call_id = make_call_id
        self._buffer = ""
        self._state = _CONTENT
        self._out: list[StreamPiece] = []
        self._pending = ""  # the raw text of a call not yet known to be one: content if its header fails
        self._skip_space = False  # after a call: blank space is held, dropped unless content follows and preceded
        self._content_sent = False
        self._in_section = False
        self._opened_section = False
        self._finished = False
        self._index = -1
        self._name = ""
        self._args_sent = ""
        self._scanned = 0
        self._pairs_sent = 0
        self._body_started = False
        self._pair: tuple[str, bool] | None = None
        self._content_triggers = tuple(m for m in (fmt.section_begin, fmt.call_begin) if m)
        bad = [fmt.call_begin, fmt.call_end, fmt.section_begin, fmt.section_end]
        self._header_markers = tuple(dict.fromkeys(
            [m for m in (fmt.header_end, *fmt.header_stops, *bad) if m]))
        self._header_bad = frozenset(m for m in bad if m and m not in fmt.header_stops)

    def parse(self, text: str) -> ParsedToolCalls:
        """The calls in a whole text (a fresh parser of the same settings reads it; this one is left as it is)."""
        fresh = ToolCallParser(self.format, tools=self._tools, make_call_id=self._make_call_id)
        return assemble_tool_calls(fresh.feed(text) + fresh.finish())

    def feed(self, delta: str) -> list[StreamPiece]:
        """The pieces this delta decides, in output order (text that may still be a marker is held back)."""
        if self._finished:
            raise RuntimeError("this ToolCallParser has finished; make a new one for the next output")
        self._buffer += delta
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[StreamPiece]:
        """The pieces held back at the end of the output: a marker begun but never completed is text, a call cut
        off ends with what it has."""
        if not self._finished:
            self._finished = True
            while self._step(final=True):
                pass
        return self._take()

    # ---- output

    def _take(self) -> list[StreamPiece]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        self._content_sent = True
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += text
        else:
            self._out.append(text)

    def _arguments(self, text: str) -> None:
        if text:
            self._out.append(ToolCallDelta(self._index, arguments=text))

    # ---- the machine: each step acts on what is decided and says whether it changed anything

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == _CONTENT:
            return self._step_content(final)
        if state == _OPENING:
            return self._step_opening(final)
        if state == _HEADER:
            return self._step_header(final)
        if state == _JSON:
            return self._step_json(final)
        if state == _PAIRS:
            return self._step_pairs(final)
        if state == _PAIR_HEAD:
            return self._step_pair_head(final)
        if state == _PAIR_VALUE:
            return self._step_pair_value(final)
        return self._step_section(final)

    def _step_content(self, final: bool) -> bool:
        text = self._buffer
        if self._skip_space:
            rest = text.lstrip(_SPACE)
            if not rest:
                if final:
                    self._buffer = ""
                return False
            if not self._content_sent:
                text = rest  # blank space after a call separates it from content before it, if there is any
            self._skip_space = False
        hit = find_first(text, self._content_triggers, final)
        if hit is None:
            if final:
                self._content(text)
                self._buffer = ""
                return False
            held = partial_suffix_len(text, self._content_triggers)
            head = text[: len(text) - held]
            sent = head.rstrip(_SPACE)
            self._content(sent)
            self._buffer = text[len(sent) :]
            return False
        index, marker = hit
        sent = text[:index].rstrip(_SPACE)
        self._content(sent)
        self._pending = text[len(sent) : index + len(marker)]
        self._buffer = text[index + len(marker) :]
        self._opened_section = marker == self.format.section_begin
        self._state = _OPENING if self._opened_section else _HEADER
        return True

    def _step_opening(self, final: bool) -> bool:
        begin = self.format.call_begin
        rest = self._buffer.lstrip(_SPACE)
        if rest.startswith(begin):
            self._pending += self._buffer[: len(self._buffer) - len(rest)] + begin
            self._buffer = rest[len(begin) :]
            self._state = _HEADER
            return True
        if not final and begin.startswith(rest):
            return False
        return self._not_a_call()

    def _not_a_call(self) -> bool:
        """The call being read is text after all: its raw text so far is content, reading goes on after it."""
        self._content(self._pending)
        self._pending = ""
        self._in_section = False
        self._state = _CONTENT
        return True

    def _step_header(self, final: bool) -> bool:
        hit = find_first(self._buffer, self._header_markers, final)
        if hit is None or hit[0] > MAX_HEADER_CHARS:
            longest = max(len(m) for m in self._header_markers)
            if final or hit is not None or len(self._buffer) >= MAX_HEADER_CHARS + longest:
                return self._not_a_call()
            return False
        index, marker = hit
        match = None if marker in self._header_bad else self.format.header.fullmatch(self._buffer[:index])
        if match is None:
            return self._not_a_call()
        self._index += 1
        groups = match.groupdict()
        call_id = groups.get("id") or self._make_call_id(self._index)
        self._name = match["name"]
        self._out.append(ToolCallDelta(self._index, id=call_id, name=self._name))
        self._pending = ""
        self._in_section = self._in_section or self._opened_section
        self._buffer = self._buffer[index + (len(marker) if marker == self.format.header_end else 0) :]
        self._args_sent, self._scanned = "", 0
        self._pairs_sent, self._body_started, self._pair = 0, False, None
        self._state = _PAIRS if self.format.pairs else _JSON
        return True

    def _end_call(self) -> None:
        self._state = _SECTION if self._in_section else _CONTENT
        self._skip_space = not self._in_section

    def _step_json(self, final: bool) -> bool:
        end = self.format.call_end
        index = self._buffer.find(end, max(0, self._scanned - len(end) + 1))
        self._scanned = len(self._buffer)
        if index < 0 and not final:
            held = partial_suffix_len(self._buffer, (end,))
            sendable = self._buffer[: len(self._buffer) - held].lstrip(_SPACE)
            sendable = sendable.rstrip(_SPACE + self.format.argument_trailer)
            self._arguments(sendable[len(self._args_sent) :])
            self._args_sent = sendable or self._args_sent
            return False
        if index < 0:
            raw = self._buffer[: len(self._buffer) - partial_suffix_len(self._buffer, (end,))]
            self._buffer = ""
        else:
            raw = self._buffer[:index]
            self._buffer = self._buffer[index + len(end) :]
        arguments = raw.lstrip(_SPACE).rstrip(_SPACE + self.format.argument_trailer)
        self._arguments(arguments[len(self._args_sent) :])
        self._end_call()
        return index >= 0

    def _step_pairs(self, final: bool) -> bool:
        pairs = self.format.pairs
        assert pairs is not None
        if not self._body_started and pairs.json_body:
            rest = self._buffer.lstrip(_SPACE)
            if not rest and not final:
                return False
            self._body_started = True
            if rest.startswith("{"):
                self._state = _JSON
                return True
        self._body_started = True
        hit = find_first(self._buffer, (pairs.begin, self.format.call_end), final)
        if hit is None:
            if final:
                self._buffer = ""
                self._close_pairs()
                return False
            self._buffer = self._buffer[len(self._buffer) - partial_suffix_len(
                self._buffer, (pairs.begin, self.format.call_end)) :]
            return False
        index, marker = hit
        self._buffer = self._buffer[index + len(marker) :]
        if marker == self.format.call_end:
            self._close_pairs()
        else:
            self._state = _PAIR_HEAD
        return True

    def _close_pairs(self) -> None:
        self._arguments("}" if self._pairs_sent else "{}")
        self._end_call()

    def _step_pair_head(self, final: bool) -> bool:
        pairs = self.format.pairs
        assert pairs is not None
        markers = (pairs.value_begin, pairs.begin, self.format.call_end)
        hit = find_first(self._buffer, markers, final)
        if hit is None or hit[0] > MAX_HEADER_CHARS or hit[1] != pairs.value_begin:
            longest = max(len(m) for m in markers)
            if final or hit is not None or len(self._buffer) >= MAX_HEADER_CHARS + longest:
                self._state = _PAIRS  # not an argument: skipped up to the next one
                return True
            return False
        index, marker = hit
        match = pairs.head.fullmatch(self._buffer[:index])
        if match is None:
            self._pair = None
        else:
            string = match.groupdict().get("string")
            key = match["key"].strip()
            is_string = string == "true" if string is not None else key in self._string_arguments.get(
                self._name, ())
            self._pair = (key, is_string)
        self._buffer = self._buffer[index + len(marker) :]
        self._state = _PAIR_VALUE
        return True

    def _step_pair_value(self, final: bool) -> bool:
        pairs = self.format.pairs
        assert pairs is not None
        index = self._buffer.find(pairs.value_end)
        if index < 0:
            if final:
                self._buffer = ""
                self._state = _PAIRS
                return True
            return False
        value = self._buffer[:index]
        self._buffer = self._buffer[index + len(pairs.value_end) :]
        if self._pair is not None:
            key, is_string = self._pair
            lead = ", " if self._pairs_sent else "{"
            self._arguments(f"{lead}{json.dumps(key, ensure_ascii=False)}: {_json_value(value, is_string)}")
            self._pairs_sent += 1
        self._state = _PAIRS
        return True

    def _step_section(self, final: bool) -> bool:
        fmt = self.format
        assert fmt.section_end is not None
        rest = self._buffer.lstrip(_SPACE)
        if rest.startswith(fmt.call_begin):
            self._pending = fmt.call_begin
            self._opened_section = False
            self._buffer = rest[len(fmt.call_begin) :]
            self._state = _HEADER
            return True
        if rest.startswith(fmt.section_end):
            self._buffer = rest[len(fmt.section_end) :]
            self._in_section = False
            self._state, self._skip_space = _CONTENT, True
            return True
        if not final and (fmt.call_begin.startswith(rest) or fmt.section_end.startswith(rest)):
            return False
        self._buffer = rest  # text that is not a call ends the section
        self._in_section = False
        self._state = _CONTENT
        return True
