"""The parsers by SGLang's flag names: `tool_call_parser(name)` and `reasoning_parser(name)` build one for an
output; an unknown name is refused in one sentence that lists the names there are."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxdp.api.parsers.reasoning import ReasoningParser
from jaxdp.api.parsers.reasoning_formats import REASONING_FORMATS
from jaxdp.api.parsers.tool_calls import ToolCallParser, random_call_id
from jaxdp.api.parsers.tool_formats import TOOL_CALL_FORMATS

TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_FORMATS)
REASONING_PARSER_NAMES = tuple(REASONING_FORMATS)


class UnknownParserError(ValueError):
    """A parser name that is not one of SGLang's names jaxdp reads."""


def _refuse(flag: str, name: str, names: Sequence[str]) -> UnknownParserError:
    return UnknownParserError(f"{flag} {name!r} is not one jaxdp knows: use one of {', '.join(names)}")


def tool_call_parser(name: str, *, tools: Sequence[Mapping[str, Any]] | None = None,
                     make_call_id: Callable[[int], str] = random_call_id) -> ToolCallParser:
    """A tool-call parser for one output in the format SGLang's `--tool-call-parser name` reads."""
    fmt = TOOL_CALL_FORMATS.get(name)
    if fmt is None:
        raise _refuse("--tool-call-parser", name, TOOL_CALL_PARSER_NAMES)
    return ToolCallParser(fmt, tools=tools, make_call_id=make_call_id)


def reasoning_parser(name: str, *, starts_open: bool | None = None) -> ReasoningParser:
    """A reasoning parser for one output in the format SGLang's `--reasoning-parser name` reads."""
    fmt = REASONING_FORMATS.get(name)
    if fmt is None:
        raise _refuse("--reasoning-parser", name, REASONING_PARSER_NAMES)
    return ReasoningParser(fmt, starts_open=starts_open)
