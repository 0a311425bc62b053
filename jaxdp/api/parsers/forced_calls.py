"""The tool calls of a forced answer (tool_choice "required" or a named function): the grammar makes the model
write them as one JSON array, `[{"name": ..., "parameters": {...}}, ...]` (SGLang's format for a forced call), and
`ToolCallArrayReader` reads it with the `ToolCallParser` interface: `feed` text deltas, `finish` once. A call goes
out whole (index, id, name and its arguments as compact JSON) once its object has closed, so a stream assembles to
exactly the whole answer's calls. An array cut off (max_tokens) keeps the calls that closed."""

from __future__ import annotations

import json
from collections.abc import Callable

from jaxdp.api.parsers.tool_calls import StreamPiece, ToolCallDelta, random_call_id

_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"


class ToolCallArrayReader:
    def __init__(self, make_call_id: Callable[[int], str] = random_call_id):
        self.make_call_id = make_call_id
        self._buffer = ""
        self._opened = False
        self._closed = False
        self._calls = 0

    def feed(self, delta: str) -> list[StreamPiece]:
        self._buffer += delta
        out: list[StreamPiece] = []
        if self._opened and not self._closed and "}" not in delta and "]" not in delta:
            return out  # (a call's object closes on a "}", the array on a "]": nothing new to read before one)
        while not self._closed:
            text = self._buffer.lstrip(_SPACE)
            if not self._opened:
                if not text:
                    break
                if text[0] != "[":  # (not the grammar's output: shown as it is)
                    self._closed = True
                    out.append(self._buffer)
                    self._buffer = ""
                    break
                self._opened, self._buffer = True, text[1:]
                continue
            text = text.lstrip(",").lstrip(_SPACE) if self._calls else text
            if text.startswith("]"):
                self._closed, self._buffer = True, ""
                break
            try:
                call, end = _DECODER.raw_decode(text)
            except ValueError:  # the object has not closed yet
                break
            self._buffer = text[end:]
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False, separators=(",", ":"))
                out.append(ToolCallDelta(self._calls, self.make_call_id(self._calls), call["name"], arguments))
                self._calls += 1
        return out

    def finish(self) -> list[StreamPiece]:
        return []
