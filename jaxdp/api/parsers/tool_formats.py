"""The tool-call formats of the models jaxdp serves, as data, under SGLang's `--tool-call-parser` names.

Written from the model cards' chat templates and the formats SGLang's and vLLM's parsers document:
- deepseekv3 (DeepSeek-V3, V3-0324, R1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>` NAME, a newline, the arguments in a ```json fence,
  `<｜tool▁call▁end｜>`; `<｜tool▁calls▁end｜>` closes;
- deepseekv31 (V3.1, V3.2-Exp): the same markers, the call
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`;
- deepseekv32 (V3.2's DSML): `<｜DSML｜function_calls>`, per call `<｜DSML｜invoke name="NAME">`, per argument
  `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>` (true: VALUE is a string as it
  stands, false: JSON), `</｜DSML｜invoke>`, `</｜DSML｜function_calls>`; a JSON object in place of the parameters
  is read too (SGLang does);
- glm45 (GLM-4.5, 4.6; SGLang's `glm` too): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n
  </tool_call>`, no section; a string VALUE is written bare, any other is JSON;
- glm47 (GLM-4.7, GLM-5): the same tags with no newlines, `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>...`;
- kimi_k2: `<|tool_calls_section_begin|>`, per call `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>`
  ARGS `<|tool_call_end|>`, `<|tool_calls_section_end|>`; `functions.NAME:N` is the call's id.
The two GLM formats are read alike (either spacing parses in both); they differ in what `grammar` renders.
"""

import re
from dataclasses import dataclass

# a function name: letters, digits, `_`, `.` and `-` (OpenAI's names, plus the dots of namespaced tools)
NAME_PATTERN = r"[\w.\-]+"


@dataclass(frozen=True)
class ToolCallGrammar:
    """What a grammar needs later to constrain a model to this format's calls, as data: the text it writes around
    a call to the function `{name}` (Kimi's also numbers its calls: `{index}`), and, where the arguments are not
    one JSON object, one argument's text with `{key}` and `{value}` (DSML adds `{string}`: "true" for a string)."""

    trigger: str  # the text that opens the tool-call part of an output
    section_begin: str  # "" where the format has no section around its calls
    call_begin: str
    call_end: str
    call_separator: str
    section_end: str
    argument: str  # "" where the arguments are one JSON object


@dataclass(frozen=True)
class PairGrammar:
    """How a format writes one argument as tags instead of JSON: `begin`, a head (the key), `value_begin`, the
    value, `value_end`. `head` matches the text between `begin` and `value_begin` whole, with a group `key` and
    optionally `string` ("true": the value is a string as it stands; otherwise JSON)."""

    begin: str
    value_begin: str
    value_end: str
    head: re.Pattern[str]
    json_body: bool  # a call may hold one JSON object instead of tags (SGLang accepts it for DSML)


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's tool-call text, as data the parser reads."""

    name: str  # SGLang's --tool-call-parser name
    section_begin: str | None
    section_end: str | None
    call_begin: str
    call_end: str
    header_end: str | None  # ends a call's header and is consumed
    header_stops: tuple[str, ...]  # end a call's header and belong to what follows it
    header: re.Pattern[str]  # matches a header whole: group `name`, optionally `id` (Kimi's call ids)
    pairs: PairGrammar | None  # None: the arguments are one JSON object as written
    argument_trailer: str  # characters stripped from the end of JSON arguments (V3's closing ``` fence)
    grammar: ToolCallGrammar


DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
DSML = "｜DSML｜"
KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
GLM_CALL_BEGIN = "<tool_call>"
GLM_CALL_END = "</tool_call>"
GLM_KEY_BEGIN = "<arg_key>"

_NAME = rf"\s*(?P<name>{NAME_PATTERN})\s*"

DEEPSEEK_V3 = ToolCallFormat(
    name="deepseekv3",
    section_begin=DS_CALLS_BEGIN, section_end=DS_CALLS_END, call_begin=DS_CALL_BEGIN, call_end=DS_CALL_END,
    header_end="```json", header_stops=(),
    header=re.compile(rf"\s*function\s*{DS_SEP}{_NAME}"),
    pairs=None, argument_trailer="`",
    grammar=ToolCallGrammar(
        trigger=DS_CALLS_BEGIN, section_begin=DS_CALLS_BEGIN,
        call_begin=DS_CALL_BEGIN + "function" + DS_SEP + "{name}\n```json\n", call_end="\n```" + DS_CALL_END,
        call_separator="\n", section_end=DS_CALLS_END, argument=""),
)

DEEPSEEK_V31 = ToolCallFormat(
    name="deepseekv31",
    section_begin=DS_CALLS_BEGIN, section_end=DS_CALLS_END, call_begin=DS_CALL_BEGIN, call_end=DS_CALL_END,
    header_end=DS_SEP, header_stops=(),
    header=re.compile(_NAME),
    pairs=None, argument_trailer="",
    grammar=ToolCallGrammar(
        trigger=DS_CALLS_BEGIN, section_begin=DS_CALLS_BEGIN,
        call_begin=DS_CALL_BEGIN + "{name}" + DS_SEP, call_end=DS_CALL_END,
        call_separator="", section_end=DS_CALLS_END, argument=""),
)

DEEPSEEK_V32 = ToolCallFormat(
    name="deepseekv32",
    section_begin=f"<{DSML}function_calls>", section_end=f"</{DSML}function_calls>",
    call_begin=f"<{DSML}invoke", call_end=f"</{DSML}invoke>",
    header_end=">", header_stops=(),
    header=re.compile(rf'\s+name="{_NAME}"\s*'),
    pairs=PairGrammar(
        begin=f"<{DSML}parameter", value_begin=">", value_end=f"</{DSML}parameter>",
        head=re.compile(r'\s+name="(?P<key>[^"]+)"\s+string="(?P<string>true|false)"\s*'), json_body=True),
    argument_trailer="",
    grammar=ToolCallGrammar(
        trigger=f"<{DSML}function_calls>", section_begin=f"<{DSML}function_calls>\n",
        call_begin=f'<{DSML}invoke name="{{name}}">\n', call_end=f"</{DSML}invoke>\n",
        call_separator="", section_end=f"</{DSML}function_calls>",
        argument=f'<{DSML}parameter name="{{key}}" string="{{string}}">{{value}}</{DSML}parameter>\n'),
)

_GLM_PAIRS = PairGrammar(
    begin=GLM_KEY_BEGIN, value_begin="<arg_value>", value_end="</arg_value>",
    head=re.compile(r"(?P<key>.*?)</arg_key>\s*", re.DOTALL), json_body=False)


def _glm(name: str, newline: str) -> ToolCallFormat:
    return ToolCallFormat(
        name=name,
        section_begin=None, section_end=None, call_begin=GLM_CALL_BEGIN, call_end=GLM_CALL_END,
        header_end=None, header_stops=(GLM_KEY_BEGIN, GLM_CALL_END),
        header=re.compile(_NAME),
        pairs=_GLM_PAIRS, argument_trailer="",
        grammar=ToolCallGrammar(
            trigger=GLM_CALL_BEGIN, section_begin="", call_begin=GLM_CALL_BEGIN + "{name}" + newline,
            call_end=GLM_CALL_END, call_separator=newline, section_end="",
            argument=f"{GLM_KEY_BEGIN}{{key}}</arg_key>{newline}<arg_value>{{value}}</arg_value>{newline}"),
    )


GLM45 = _glm("glm45", "\n")
GLM47 = _glm("glm47", "")

KIMI_K2 = ToolCallFormat(
    name="kimi_k2",
    section_begin=KIMI_SECTION_BEGIN, section_end=KIMI_SECTION_END, call_begin=KIMI_CALL_BEGIN,
    call_end=KIMI_CALL_END,
    header_end=KIMI_ARGUMENTS_BEGIN, header_stops=(),
    header=re.compile(rf"\s*(?P<id>(?:functions\.)?(?P<name>{NAME_PATTERN}):\d+)\s*"),
    pairs=None, argument_trailer="",
    grammar=ToolCallGrammar(
        trigger=KIMI_SECTION_BEGIN, section_begin=KIMI_SECTION_BEGIN,
        call_begin=KIMI_CALL_BEGIN + "functions.{name}:{index}" + KIMI_ARGUMENTS_BEGIN, call_end=KIMI_CALL_END,
        call_separator="", section_end=KIMI_SECTION_END, argument=""),
)

TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "deepseekv3": DEEPSEEK_V3,
    "deepseekv31": DEEPSEEK_V31,
    "deepseekv32": DEEPSEEK_V32,
    "glm": GLM45,
    "glm45": GLM45,
    "glm47": GLM47,
    "kimi_k2": KIMI_K2,
}
