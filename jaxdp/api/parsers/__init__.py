"""Tool-call and reasoning parsers for chat outputs (SGLang's `--tool-call-parser` and `--reasoning-parser`):
pure text in, OpenAI's message fields out, streamed or not, with no dependency on the engine or JAX."""

from jaxdp.api.parsers.reasoning import ReasoningFormat, ReasoningParser, ReasoningSplit
from jaxdp.api.parsers.registry import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    UnknownParserError,
    reasoning_parser,
    tool_call_parser,
)
from jaxdp.api.parsers.tool_calls import (
    ParsedToolCalls,
    StreamPiece,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    assemble_tool_calls,
)
from jaxdp.api.parsers.tool_formats import ToolCallFormat, ToolCallGrammar

__all__ = [
    "REASONING_PARSER_NAMES",
    "TOOL_CALL_PARSER_NAMES",
    "ParsedToolCalls",
    "ReasoningFormat",
    "ReasoningParser",
    "ReasoningSplit",
    "StreamPiece",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallGrammar",
    "ToolCallParser",
    "UnknownParserError",
    "assemble_tool_calls",
    "reasoning_parser",
    "tool_call_parser",
]
