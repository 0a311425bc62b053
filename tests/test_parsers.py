"""Issue 46 (points 3 and 4, parsing): the tool-call and reasoning parsers of `jaxdp.api.parsers`.

Per format, examples written from the documented formats (one call, two parallel calls, text before a call,
arguments with nested JSON and unicode, no call, a malformed call) parse to what the format means; the same texts
streamed, cut at every point, at random points (hypothesis) and one character at a time, assemble to exactly the
one-shot result; random texts built from the formats' own markers do too (the machines decide nothing early); the
grammar facts each format renders parse back to the call they describe; an unknown parser name is refused."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdp.api.parsers import (
    REASONING_PARSER_NAMES,
    TOOL_CALL_PARSER_NAMES,
    ParsedToolCalls,
    ReasoningSplit,
    ToolCallDelta,
    UnknownParserError,
    assemble_tool_calls,
    reasoning_parser,
    tool_call_parser,
)
from jaxdp.api.parsers.tool_formats import TOOL_CALL_FORMATS

WEATHER = {"city": "Tokyo"}
NESTED = {"query": {"filters": [{"field": "städte", "in": ["東京", "Zürich"]}], "limit": 3}, "note": "naïve ✓ 🚀"}
FIND = {"path": "src/main.py", "depth": 2, "recursive": True}


def ids(index: int) -> str:
    return f"call_{index}"


def make(name: str, **kwargs):
    return tool_call_parser(name, make_call_id=ids, **kwargs)


def dumps(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


# ---- each format's text for a list of calls, written the way its model card's template writes them


def deepseekv3(calls):
    body = "\n".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{dumps(args)}\n```"
                     "<｜tool▁call▁end｜>" for name, args in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseekv31(calls):
    body = "".join(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{dumps(args)}<｜tool▁call▁end｜>" for name, args in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseekv32(calls):
    def parameter(key, value):
        text, string = (value, "true") if isinstance(value, str) else (dumps(value), "false")
        return f'<｜DSML｜parameter name="{key}" string="{string}">{text}</｜DSML｜parameter>\n'

    body = "".join(f'<｜DSML｜invoke name="{name}">\n' + "".join(parameter(k, v) for k, v in args.items())
                   + "</｜DSML｜invoke>\n" for name, args in calls)
    return f"<｜DSML｜function_calls>\n{body}</｜DSML｜function_calls>"


def glm(newline):
    def render(calls):
        def pair(key, value):
            text = value if isinstance(value, str) else dumps(value)
            return f"<arg_key>{key}</arg_key>{newline}<arg_value>{text}</arg_value>{newline}"

        return newline.join(f"<tool_call>{name}{newline}" + "".join(pair(k, v) for k, v in args.items())
                            + "</tool_call>" for name, args in calls)

    return render


def kimi_k2(calls):
    body = "".join(f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{dumps(args)}<|tool_call_end|>"
                   for i, (name, args) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


RENDER = {"deepseekv3": deepseekv3, "deepseekv31": deepseekv31, "deepseekv32": deepseekv32,
          "glm45": glm("\n"), "glm47": glm(""), "kimi_k2": kimi_k2}

# a call whose header does not parse (a name with a space): the text stays content, the peers' rule
MALFORMED = {
    "deepseekv3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get weather\n```json\n{}\n```"
                  "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseekv31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                   "<｜tool▁calls▁end｜>",
    "deepseekv32": '<｜DSML｜function_calls>\n<｜DSML｜invoke nom="get_weather">\n</｜DSML｜invoke>\n'
                   "</｜DSML｜function_calls>",
    "glm45": "<tool_call>get weather\n<arg_key>city</arg_key>\n<arg_value>Tokyo</arg_value>\n</tool_call>",
    "glm47": "<tool_call>get weather<arg_key>city</arg_key><arg_value>Tokyo</arg_value></tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather<|tool_call_argument_begin|>{}"
               "<|tool_call_end|><|tool_calls_section_end|>",
}

FORMATS = sorted(RENDER)


def examples(name):
    """(text, content, [(function, arguments)]) per documented case of the format."""
    render = RENDER[name]
    one = [("get_weather", WEATHER)]
    two = [("get_weather", WEATHER), ("find_files", FIND)]
    return [
        ("one call", render(one), "", one),
        ("two parallel calls", render(two), "", two),
        ("text before a call", "Let me look that up.\n\n" + render(one), "Let me look that up.", one),
        ("nested JSON and unicode", "Je cherche… " + render([("search", NESTED)]), "Je cherche…",
         [("search", NESTED)]),
        ("no call", "The weather in Tokyo is sunny, 22 °C. <b>Enjoy</b> {\"a\": 1}",
         "The weather in Tokyo is sunny, 22 °C. <b>Enjoy</b> {\"a\": 1}", []),
        ("malformed call", "Trying: " + MALFORMED[name], "Trying: " + MALFORMED[name], []),
    ]


CASES = [(name, *case) for name in FORMATS for case in examples(name)]


def streamed(parser, pieces):
    out = []
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


def cut(text, points):
    points = sorted(set(points))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@pytest.mark.parametrize("name,case,text,content,calls", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_tool_call_examples(name, case, text, content, calls):
    parsed = make(name).parse(text)
    assert parsed.content == content
    assert [c.name for c in parsed.calls] == [name for name, _ in calls]
    assert [json.loads(c.arguments) for c in parsed.calls] == [args for _, args in calls]
    expected_ids = [f"functions.{n}:{i}" for i, (n, _) in enumerate(calls)] if name == "kimi_k2" else [
        ids(i) for i in range(len(calls))]
    assert [c.id for c in parsed.calls] == expected_ids
    if name not in ("deepseekv32", "glm45", "glm47"):  # JSON arguments go through as the model wrote them
        assert [c.arguments for c in parsed.calls] == [dumps(args) for _, args in calls]
    # one character at a time: every delta's pieces are in OpenAI's order for a call
    pieces = streamed(make(name), list(text))
    assert assemble_tool_calls(pieces) == parsed
    seen = set()
    for piece in pieces:
        if isinstance(piece, ToolCallDelta):
            assert (piece.name is not None) == (piece.index not in seen), "id and name first, once"
            assert piece.index == len(seen) - (piece.index in seen)
            seen.add(piece.index)
    # at every single cut
    for point in range(len(text) + 1):
        assert assemble_tool_calls(streamed(make(name), cut(text, [point]))) == parsed, point


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(st.data())
def test_tool_calls_streamed_at_random_cuts_equal_one_shot(data):
    name, _case, text, _content, _calls = data.draw(st.sampled_from(CASES))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert assemble_tool_calls(streamed(make(name), cut(text, points))) == make(name).parse(text)


def fragments(name):
    fmt = TOOL_CALL_FORMATS[name]
    markers = [m for m in (fmt.section_begin, fmt.section_end, fmt.call_begin, fmt.call_end, fmt.header_end,
                           *fmt.header_stops) if m]
    if fmt.pairs:
        markers += [fmt.pairs.begin, fmt.pairs.value_begin, fmt.pairs.value_end]
    halves = [m[: len(m) // 2] for m in markers] + [m[len(m) // 2 :] for m in markers]
    return markers + halves + ["function", ' name="x"', "functions.f:0", "{", "}", "```", "\n", " ", "ok", "東京"]


ARGUMENTS = st.dictionaries(st.sampled_from(["a", "city", "ключ", "n"]),
                            st.one_of(st.integers(-5, 5), st.booleans(), st.sampled_from(["x", "東京 ✓", "007", ""]),
                                      st.lists(st.integers(0, 3), max_size=2)), max_size=3)
CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "f", "ns.tool-2"]), ARGUMENTS), min_size=1, max_size=3)


@st.composite
def messy_outputs(draw, name):
    """An output of the format: words, whole tool-call parts and stray markers in any order, then cut about: a
    piece deleted, a marker or half of one put in, the end cut off (max_tokens)."""
    words = ["Sure.", " ", "\n\n", "done", "<b>", "{}"]
    parts = draw(st.lists(st.one_of(st.sampled_from(words), st.sampled_from(fragments(name)),
                                    CALLS.map(RENDER[name])), max_size=5))
    text = "".join(parts)
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["delete", "insert", "truncate"]))
        if action == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 12)):]
        elif action == "insert":
            text = text[:at] + draw(st.sampled_from(fragments(name))) + text[at:]
        else:
            text = text[:at]
    return text


@settings(max_examples=600, derandomize=True, deadline=None, database=None)
@given(st.data())
def test_any_text_streams_to_its_one_shot_parse(data):
    """Whatever a messy output parses to (calls, broken calls, calls cut off), a stream cut anywhere gives the same:
    the machines act only on what no later text can change."""
    name = data.draw(st.sampled_from(FORMATS))
    text = data.draw(messy_outputs(name))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    one_shot = make(name).parse(text)
    assert assemble_tool_calls(streamed(make(name), cut(text, points))) == one_shot
    assert assemble_tool_calls(streamed(make(name), list(text))) == one_shot
    for call in one_shot.calls:
        assert call.name


@pytest.mark.parametrize("name", FORMATS)
def test_whole_calls_in_messy_outputs_parse(name):
    """Calls rendered whole between words and stray text all come out, with their arguments."""
    calls = [("get_weather", WEATHER), ("f", {"ключ": ["東京 ✓", 1]})]
    text = "a <b> c\n" + RENDER[name](calls) + "\nthen " + RENDER[name](calls[:1])
    parsed = make(name).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls + calls[:1]
    assert parsed.content == "a <b> c\nthen"


def test_text_between_and_after_calls_is_content():
    text = "<tool_call>a<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>\nthen\n<tool_call>b</tool_call>\n"
    parsed = make("glm47").parse(text)
    assert parsed.content == "then"
    assert make("glm45").parse("Checking.\n" + text).content == "Checking.\nthen"
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", '{"x": 1}'), ("b", "{}")]
    after = make("deepseekv31").parse(deepseekv31([("f", {})]) + "\n\nDone.")
    assert after.content == "Done." and after.calls[0].arguments == "{}"


def test_a_call_cut_off_keeps_what_it_has():
    """max_tokens mid-call: JSON arguments end as they stand, key/value pairs keep the complete ones."""
    text = deepseekv31([("get_weather", WEATHER)])
    cut_text = text[: text.index("Tokyo") + 3]
    parsed = make("deepseekv31").parse(cut_text)
    assert parsed.calls[0].arguments == '{"city": "Tok' and parsed.content == ""
    glm_text = glm("")([("f", {"a": "x", "b": 2})])
    parsed = make("glm47").parse(glm_text[: glm_text.index("<arg_value>2")])
    assert parsed.calls[0].arguments == '{"a": "x"}'
    header_only = "So: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_wea"
    assert make("deepseekv31").parse(header_only) == ParsedToolCalls(header_only, ())


def test_glm_string_arguments_follow_the_tool_schema():
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"zip": {"type": "string"}, "count": {"type": "integer"}}}}}]
    text = "<tool_call>lookup<arg_key>zip</arg_key><arg_value>12345</arg_value>" \
           "<arg_key>count</arg_key><arg_value>12345</arg_value></tool_call>"
    assert json.loads(make("glm47", tools=tools).parse(text).calls[0].arguments) == {"zip": "12345", "count": 12345}
    assert json.loads(make("glm47").parse(text).calls[0].arguments) == {"zip": 12345, "count": 12345}


def test_dsml_reads_a_json_body_and_typed_parameters():
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n{"a": [1, 2]}\n</｜DSML｜invoke>\n'
            "</｜DSML｜function_calls>")
    assert make("deepseekv32").parse(text).calls[0].arguments == '{"a": [1, 2]}'
    typed = deepseekv32([("f", {"s": "007", "n": 7, "o": {"k": None}})])
    assert json.loads(make("deepseekv32").parse(typed).calls[0].arguments) == {"s": "007", "n": 7, "o": {"k": None}}


def test_deltas_are_openai_pieces():
    pieces = streamed(make("kimi_k2"), [kimi_k2([("get_weather", WEATHER)])])
    assert [p.to_openai() for p in pieces if isinstance(p, ToolCallDelta)] == [
        {"index": 0, "id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": dumps(WEATHER)}},
    ]
    parser = make("glm45")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("more")


@pytest.mark.parametrize("name", FORMATS)
def test_grammar_facts_render_calls_the_parser_reads(name):
    """The markers each format gives the grammar layer, filled in, are calls its parser reads back."""
    grammar = TOOL_CALL_FORMATS[name].grammar
    calls = [("get_weather", WEATHER), ("find_files", FIND)]
    body = []
    for index, (function, arguments) in enumerate(calls):
        if grammar.argument:
            args = "".join(grammar.argument.format(
                key=k, value=v if isinstance(v, str) else dumps(v), string=str(isinstance(v, str)).lower())
                for k, v in arguments.items())
        else:
            args = dumps(arguments)
        body.append(grammar.call_begin.format(name=function, index=index) + args + grammar.call_end)
    text = "Sure. " + grammar.section_begin + grammar.call_separator.join(body) + grammar.section_end
    assert text[len("Sure. "):].startswith(grammar.trigger)
    parsed = make(name).parse(text)
    assert parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def test_unknown_parser_names_are_refused_in_one_sentence():
    assert set(TOOL_CALL_PARSER_NAMES) == {"deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45", "glm47",
                                           "kimi_k2"}
    assert set(REASONING_PARSER_NAMES) == {"deepseek-r1", "deepseek-v3", "glm45", "kimi_k2"}
    with pytest.raises(UnknownParserError, match=r"^--tool-call-parser 'qwen25' is not one jaxdp knows: use one "
                                                 r"of deepseekv3, deepseekv31, .*kimi_k2$"):
        tool_call_parser("qwen25")
    with pytest.raises(ValueError, match=r"^--reasoning-parser 'deepseek_r1' is not one jaxdp knows: use one of "
                                         r"deepseek-r1, deepseek-v3, glm45, kimi_k2$"):
        reasoning_parser("deepseek_r1")


# ---- reasoning

REASONING_CASES = [
    # (parser, starts_open, text, reasoning, content)
    ("deepseek-r1", None, "The user wants 6*7.\nThat is 42.\n</think>\n\n42", "The user wants 6*7.\nThat is 42.", "42"),
    ("deepseek-r1", None, "<think>\nR1-0528 opens the tag again.\n</think>\n\nYes.", "R1-0528 opens the tag again.",
     "Yes."),
    ("deepseek-r1", None, "Cut off while still thinking about <b>", "Cut off while still thinking about <b>", ""),
    ("deepseek-r1", None, "\n</think>Nothing to think.", "", "Nothing to think."),
    ("deepseek-v3", None, "Plain answer, no <think> here.", "", "Plain answer, no <think> here."),
    ("deepseek-v3", None, "<think>思考中…</think>答え: 東京", "思考中…", "答え: 東京"),
    ("deepseek-v3", True, "Thinking on: the template opened it.</think>\n\nDone",
     "Thinking on: the template opened it.", "Done"),
    ("deepseek-v3", False, "  <thin", "", "  <thin"),
    ("glm45", None, "<think>Need the weather.</think>\n<tool_call>get_weather</tool_call>", "Need the weather.",
     "<tool_call>get_weather</tool_call>"),
    ("glm45", None, "<think>Calling straight away<tool_call>get_weather</tool_call>", "Calling straight away",
     "<tool_call>get_weather</tool_call>"),
    ("glm45", None, "No reasoning at all.\n", "", "No reasoning at all.\n"),
    ("kimi_k2", None, "<think>plan</think>answer</think>", "plan", "answer</think>"),
    ("kimi_k2", None, "<think>plan<|tool_calls_section_begin|><|tool_call_begin|>", "plan",
     "<|tool_calls_section_begin|><|tool_call_begin|>"),
    ("kimi_k2", True, "open already</think>x", "open already", "x"),
]


@pytest.mark.parametrize("name,starts_open,text,reasoning,content", REASONING_CASES)
def test_reasoning_examples(name, starts_open, text, reasoning, content):
    parsed = reasoning_parser(name, starts_open=starts_open).parse(text)
    assert parsed == ReasoningSplit(reasoning, content)
    for point in range(len(text) + 1):
        assert joined(reasoning_parser(name, starts_open=starts_open), cut(text, [point])) == parsed, point
    assert joined(reasoning_parser(name, starts_open=starts_open), list(text)) == parsed


def joined(parser, pieces):
    splits = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return ReasoningSplit("".join(s.reasoning_content for s in splits), "".join(s.content for s in splits))


@settings(max_examples=400, derandomize=True, deadline=None, database=None)
@given(st.data())
def test_any_text_splits_its_reasoning_alike_streamed(data):
    name = data.draw(st.sampled_from(sorted(REASONING_PARSER_NAMES)))
    starts_open = data.draw(st.sampled_from([None, True, False]))
    words = ["<think>", "</think>", "<thi", "nk>", "</th", "<tool_call>", "<|tool_calls_section_begin|>", " ", "\n",
             "a", "思", "<", ">"]
    text = "".join(data.draw(st.lists(st.sampled_from(words), max_size=25)))
    points = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    one_shot = reasoning_parser(name, starts_open=starts_open).parse(text)
    assert joined(reasoning_parser(name, starts_open=starts_open), cut(text, points)) == one_shot
