"""The one table of request fields: per endpoint, every field a client may send, what it accepts, and whether
jaxdp honours it (and the test that shows it), accepts it without effect (and why it has none), or refuses it
unless its value is neutral (and what neutral value to send).

The parsers check every body against it (`jaxdp.api.fields.check_fields`): a refused field with a value that
would change the output is a 400 naming the field. docs/api.md carries `markdown()` of it, and
tests/test_request_fields.py walks the openai client's request types and SGLang's sampling parameters against
it. The fields listed come from OpenAI's request schemas (the installed `openai` package), SGLang's /generate
and sampling parameters (its documentation) and the extras vLLM and SGLang accept on their OpenAI endpoints.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any


class Status(enum.Enum):
    HONOURED = "honoured"
    NO_EFFECT = "accepted without effect"
    REFUSED = "refused unless neutral"


@dataclasses.dataclass(frozen=True)
class Field:
    """One request field. `where`: for an honoured field the test that shows it is served
    (`tests/file.py::test_name`), for a field without effect why it has none, for a refused one the neutral
    value(s) the refusal names ("leave it out or send ..."). A refused field may carry null, one of
    `neutral_values`, or a value `neutral_when` accepts. An honoured field that serves some of its values only
    has `refusal`: for a value it does not serve, the rest of the sentence that refuses it (after the field's
    name), else None."""

    status: Status
    accepts: str
    where: str
    neutral_values: tuple[Any, ...] = ()
    neutral_when: Callable[[Any], bool] | None = None
    refusal: Callable[[Any], str | None] | None = None

    def is_neutral(self, value: Any) -> bool:
        return (value is None or any(_same(value, v) for v in self.neutral_values)
                or (self.neutral_when is not None and self.neutral_when(value)))


def honoured(accepts: str, test: str, *, refusal: Callable[[Any], str | None] | None = None) -> Field:
    return Field(Status.HONOURED, accepts, test, refusal=refusal)


def no_effect(accepts: str, why: str) -> Field:
    return Field(Status.NO_EFFECT, accepts, why)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1 and 0 is not false."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isfinite(a) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def refused(accepts: str, *neutral_values: Any, send: str | None = None,
            neutral_when: Callable[[Any], bool] | None = None) -> Field:
    """A field jaxdp does not serve yet: refused unless null, one of `neutral_values`, or what `neutral_when`
    accepts. `send`: how the refusal names the neutral value (default: the neutral values as JSON)."""
    shown = send or " or ".join(_json(v) for v in neutral_values) or "null"
    return Field(Status.REFUSED, accepts, shown, neutral_values, neutral_when)


def _json(value: Any) -> str:
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}": {_json(v)}' for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_json(v) for v in value) + "]"
    return str(value)


# ---- the tests that show a field honoured -------------------------------------------------------------------
FIELDS_TEST = "tests/test_request_fields.py"
OPENAI_SAMPLING_TEST = f"{FIELDS_TEST}::test_openai_sampling_fields_reach_the_sampling_params"
NATIVE_SAMPLING_TEST = f"{FIELDS_TEST}::test_native_sampling_fields_reach_the_sampling_params"
PINS_TEST = f"{FIELDS_TEST}::test_rank_pins_and_bootstrap_fields_are_read"
OPENAI_COMPLETIONS_TEST = "tests/test_server.py::test_completions_with_the_openai_client"
OPENAI_CHAT_TEST = "tests/test_server.py::test_chat_and_streaming_with_the_openai_client"
ECHO_TEST = ("tests/test_eval_endpoints.py::"
             "test_echo_returns_the_tokens_the_server_used_and_the_same_logprobs_everywhere")
GENERATE_TEST = "tests/test_server.py::test_generate_pins_ranks_and_streams"
TOP_LOGPROBS_TEST = "tests/test_reliability.py::test_9_top_logprobs_hold_the_real_top_k"
ROLES_TEST = f"{FIELDS_TEST}::test_messages_carry_role_content_and_name_to_the_template"
TOOLS_TEST = "tests/test_tool_calls_api.py::test_a_tool_call_streamed_and_not_with_the_text_before_it"
PARALLEL_TOOLS_TEST = "tests/test_tool_calls_api.py::test_parallel_tool_calls_false_keeps_the_first_call"
TOOL_TURN_TEST = "tests/test_tool_calls_api.py::test_a_two_turn_tool_conversation_reaches_the_template"
REASONING_TEST = "tests/test_tool_calls_api.py::test_reasoning_content_streamed_and_not"
MIN_TOKENS_TEST = "tests/test_sampling_controls.py::test_min_tokens_holds_off_eos_and_stop_ids_from_the_api_on"
STRUCTURED = "tests/test_structured_outputs.py"
RESPONSE_FORMAT_TEST = f"{STRUCTURED}::test_response_format_json_schema_validates_and_parse_returns_an_object"
GRAMMAR_FIELDS_TEST = f"{STRUCTURED}::test_sglang_regex_ebnf_and_json_schema_on_every_endpoint"
FORCED_TOOLS_TEST = f"{STRUCTURED}::test_tool_choice_required_and_named_return_valid_calls"
_GRAMMAR = (", compiled by --grammar-backend (one grammar a request: two are refused; one that does not compile is "
            "refused in one sentence), applied in the step on the device (in the verify too when speculating: each "
            "draft checked against it)")
CONTROLS_TEST = "tests/test_sampling_controls.py::test_penalties_and_logit_bias_reach_the_sampling_params"
_IN_STEP = ", applied in the step on the device (in the verify too when speculating)"
STOPS_TEST = "tests/test_text_view.py::test_stop_regex_and_no_stop_trim_cut_where_the_whole_text_rule_does"
_STOP_REGEX = ("a regular expression (RE2: no look-around or back-references) or up to 16 of 1 to 256 characters; "
               "a match in the text of the last 64 output tokens stops the request, and the text is cut before it")
_NO_TRIM = "true or false: the stop string (or stop_regex match) stays in the text"

# ---- fields every OpenAI endpoint shares ---------------------------------------------------------------------
_NO_MEANING = "carries no meaning for a self-hosted server; the answer is the same without it"
OPENAI_COMMON: dict[str, Field] = {
    "model": no_effect("a string", "this server serves one model under any name (as SGLang and vLLM do)"),
    "max_tokens": honoured("an integer from 1 to the context left by the prompt", OPENAI_SAMPLING_TEST),
    "temperature": honoured("a number, 0 (greedy) or more", OPENAI_SAMPLING_TEST),
    "top_p": honoured("a number in (0, 1]", OPENAI_SAMPLING_TEST),
    "seed": honoured("an integer (n choices get seed, seed+1, ...)", OPENAI_SAMPLING_TEST),
    "stop": honoured("a string or up to 16 strings of 1 to 256 characters", OPENAI_SAMPLING_TEST),
    "n": honoured("an integer from 1 to 16", OPENAI_COMPLETIONS_TEST),
    "stream": honoured("true or false", OPENAI_COMPLETIONS_TEST),
    "stream_options": honoured('{"include_usage": bool}; include_obfuscation is accepted without effect',
                               OPENAI_COMPLETIONS_TEST),
    "user": no_effect("a string", _NO_MEANING),
    "frequency_penalty": honoured("a number in [-2, 2] (OpenAI's: times each output token's count)" + _IN_STEP,
                                  CONTROLS_TEST),
    "presence_penalty": honoured("a number in [-2, 2] (OpenAI's: once per token in the output)" + _IN_STEP,
                                 CONTROLS_TEST),
    "logit_bias": honoured("an object of up to 300 token id: bias in [-100, 100], added to the logits" + _IN_STEP,
                           CONTROLS_TEST),
    # SGLang's extras on its OpenAI endpoints, served here too
    "top_k": honoured("-1 (all tokens) or an integer from 1", OPENAI_SAMPLING_TEST),
    "min_p": honoured("a number in [0, 1]", OPENAI_SAMPLING_TEST),
    "ignore_eos": honoured("true or false", OPENAI_SAMPLING_TEST),
    "stop_token_ids": honoured("up to 256 token ids", OPENAI_SAMPLING_TEST),
    "routed_dp_rank": honoured("an integer DP rank of this server", PINS_TEST),
    "data_parallel_rank": honoured("an integer DP rank (deprecated name of routed_dp_rank; logged once)", PINS_TEST),
    "bootstrap_host": honoured("a host name, under prefill/decode disaggregation (SGLang's router adds it)", PINS_TEST),
    "bootstrap_port": honoured("a port, under prefill/decode disaggregation", PINS_TEST),
    "bootstrap_room": honoured("an integer room, under prefill/decode disaggregation", PINS_TEST),
    "disagg_prefill_dp_rank": honoured("the prefill server's DP rank, under disaggregation", PINS_TEST),
    "prompt_logprobs": honoured("vLLM's: an integer from 0 to 20, alternatives per prompt position", ECHO_TEST),
    # what vLLM and SGLang accept on their OpenAI endpoints and jaxdp does not serve yet
    "repetition_penalty": honoured("a number in (0, 2] (over prompt and output tokens, as vLLM)" + _IN_STEP,
                                   CONTROLS_TEST),
    "min_tokens": honoured("an integer from 0 to max_tokens, beside at most 16 stop_token_ids: no eos, stop id or "
                           "stop string ends it before (in the verify too when speculating)", MIN_TOKENS_TEST),
    "skip_special_tokens": refused("true or false", True),
    "spaces_between_special_tokens": refused("true or false", True),
    "include_stop_str_in_output": honoured(_NO_TRIM + " (vLLM's name of no_stop_trim)", OPENAI_SAMPLING_TEST),
    "no_stop_trim": honoured(_NO_TRIM, STOPS_TEST),
    "regex": honoured("a regular expression the output matches (SGLang's)" + _GRAMMAR, GRAMMAR_FIELDS_TEST),
    "ebnf": honoured("a GBNF grammar the output follows (SGLang's)" + _GRAMMAR, GRAMMAR_FIELDS_TEST),
    "json_schema": honoured("a JSON schema (text or object) the output follows (SGLang's)" + _GRAMMAR,
                            GRAMMAR_FIELDS_TEST),
    "structural_tag": refused("a structural tag (SGLang's constrained decoding)"),
    "guided_json": refused("vLLM's guided decoding"),
    "guided_regex": refused("vLLM's guided decoding"),
    "guided_choice": refused("vLLM's guided decoding"),
    "guided_grammar": refused("vLLM's guided decoding"),
    "structured_outputs": refused("vLLM's structured outputs"),
    "response_format": honoured('{"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, '
                                'strict}}' + _GRAMMAR, RESPONSE_FORMAT_TEST),
    "allowed_token_ids": refused("a list of token ids"),
    "bad_words": refused("a list of strings", []),
    "truncate_prompt_tokens": refused("an integer"),
    "use_beam_search": refused("true or false", False),
    "length_penalty": refused("a number", 1),
    "lora_path": refused("a LoRA adapter"),
    "return_hidden_states": refused("true or false", False),
}

COMPLETIONS: dict[str, Field] = OPENAI_COMMON | {
    "prompt": honoured("a string, a list of strings, token ids, or a list of token id lists", OPENAI_COMPLETIONS_TEST),
    "echo": honoured("true or false (not with stream)", ECHO_TEST),
    "logprobs": honoured("an integer from 0 to 5, alternatives per token", ECHO_TEST),
    "best_of": refused("an integer", 1),
    "suffix": refused("a string", ""),
}

CHAT: dict[str, Field] = OPENAI_COMMON | {
    "messages": honoured("a list of {role, content, name}; see MESSAGE", OPENAI_CHAT_TEST),
    "max_completion_tokens": honoured("as max_tokens (read when max_tokens is absent)", OPENAI_SAMPLING_TEST),
    "logprobs": honoured("true or false", TOP_LOGPROBS_TEST),
    "top_logprobs": honoured("an integer from 0 to 20, with logprobs: true", TOP_LOGPROBS_TEST),
    "metadata": no_effect("an object", _NO_MEANING),
    "store": no_effect("true or false", "this server stores no completions"),
    "service_tier": no_effect("a string", "this server has one tier"),
    "safety_identifier": no_effect("a string", _NO_MEANING),
    "prompt_cache_key": no_effect("a string", "the prefix cache finds shared prefixes by their tokens"),
    "prompt_cache_retention": no_effect("a string", "the prefix cache keeps pages while there is room"),
    "prompt_cache_options": no_effect("an object", "the prefix cache finds shared prefixes by their tokens"),
    "prediction": no_effect("predicted output content", "a latency hint: the answer is the same without it"),
    "parallel_tool_calls": honoured("true or false (false: the first call only)", PARALLEL_TOOLS_TEST),
    "tools": honoured('a list of {"type": "function", "function": {name, description, parameters}}, handed to '
                      "the chat template", TOOLS_TEST),
    "tool_choice": honoured('"auto", "none", "required" or {"type": "function", "function": {"name": ...}} '
                            '(the last two: a grammar makes the model call)', FORCED_TOOLS_TEST),
    "functions": refused("a list of function definitions (deprecated tools)", []),
    "function_call": refused('"none", "auto" or a named function (deprecated tool_choice)', "none", "auto"),
    "audio": refused("audio output parameters"),
    "modalities": refused('a list of "text" and "audio"', ["text"]),
    "reasoning_effort": refused("a reasoning effort"),
    "verbosity": refused('"low", "medium" or "high"'),
    "web_search_options": refused("web search options"),
    "moderation": refused("a moderation model and policy"),
    # vLLM's and SGLang's chat extras
    "echo": refused("true or false (vLLM: the last message first)", False),
    "add_generation_prompt": refused("true or false", True),
    "continue_final_message": refused("true or false", False),
    "chat_template": refused("a jinja2 template"),
    "chat_template_kwargs": honoured("an object of keyword arguments for the chat template (thinking, "
                                     "enable_thinking, ...)", REASONING_TEST),
    "separate_reasoning": honoured("true or false (default true): reasoning_content apart, with --reasoning-parser",
                                   REASONING_TEST),
}

# One message of a chat's messages. The role is the chat template's to judge; the deprecated function role is refused.
MESSAGE: dict[str, Field] = {
    "role": honoured('"system", "developer", "user", "assistant" or "tool" (what the chat template takes)',
                     ROLES_TEST),
    "content": honoured("a string or a list of text parts (null beside an assistant's tool_calls)", ROLES_TEST),
    "name": honoured("a string, handed to the chat template with the message", ROLES_TEST),
    "tool_calls": honoured("the assistant's tool calls, handed to the chat template", TOOL_TURN_TEST),
    "tool_call_id": honoured("the tool call a tool message answers, handed to the chat template", TOOL_TURN_TEST),
    "function_call": refused("the assistant's function call (deprecated tool_calls)"),
    "refusal": refused("the assistant's refusal text"),
    "audio": refused("a previous audio answer"),
}
REFUSED_ROLES = ("function",)

GENERATE: dict[str, Field] = {
    "text": honoured("a string or a list of 1 to 256 strings", GENERATE_TEST),
    "input_ids": honoured("token ids or a list of token id lists", GENERATE_TEST),
    "sampling_params": honoured("an object (see SAMPLING_PARAMS), or one per prompt", GENERATE_TEST),
    "stream": honoured("true or false", GENERATE_TEST),
    "rid": honoured("a string of 1 to 256 characters, or one per prompt",
                    "tests/test_reliability.py::test_9_abort_request_by_rid_and_all"),
    "return_logprob": honoured("true or false", GENERATE_TEST),
    "logprob_start_len": honoured("-1 (no prompt logprobs) or a prompt position", ECHO_TEST),
    "top_logprobs_num": honoured("an integer from 0 to 20", ECHO_TEST),
    "token_ids_logprob": honoured("a list of token ids", ECHO_TEST),
    "return_text_in_logprobs": no_effect("true or false", "the logprob triples always carry the token's text"),
    "routed_dp_rank": OPENAI_COMMON["routed_dp_rank"],
    "data_parallel_rank": OPENAI_COMMON["data_parallel_rank"],
    "bootstrap_host": OPENAI_COMMON["bootstrap_host"],
    "bootstrap_port": OPENAI_COMMON["bootstrap_port"],
    "bootstrap_room": OPENAI_COMMON["bootstrap_room"],
    "disagg_prefill_dp_rank": OPENAI_COMMON["disagg_prefill_dp_rank"],
    "input_embeds": refused("prompt embeddings"),
    "image_data": refused("images", []),
    "audio_data": refused("audio", []),
    "video_data": refused("video", []),
    "lora_path": refused("a LoRA adapter"),
    "custom_logit_processor": refused("a serialized CustomLogitProcessor"),
    "return_hidden_states": refused("true or false", False),
    "return_routed_experts": refused("true or false", False),
}

SAMPLING_PARAMS: dict[str, Field] = {
    "max_new_tokens": honoured("an integer from 1 to the context left by the prompt (default 128)",
                               NATIVE_SAMPLING_TEST),
    "temperature": honoured("a number, 0 (greedy) or more", NATIVE_SAMPLING_TEST),
    "top_p": honoured("a number in (0, 1]", NATIVE_SAMPLING_TEST),
    "top_k": honoured("-1 (all tokens) or an integer from 1", NATIVE_SAMPLING_TEST),
    "min_p": honoured("a number in [0, 1]", NATIVE_SAMPLING_TEST),
    "stop": honoured("a string or up to 16 strings of 1 to 256 characters", NATIVE_SAMPLING_TEST),
    "stop_token_ids": honoured("up to 256 token ids", NATIVE_SAMPLING_TEST),
    "ignore_eos": honoured("true or false", NATIVE_SAMPLING_TEST),
    "n": honoured("an integer from 1 to 16 (the first prompt's)", NATIVE_SAMPLING_TEST),
    "skip_special_tokens": honoured("true or false (the first prompt's)", NATIVE_SAMPLING_TEST),
    "seed": honoured("an integer (jaxdp's name; n choices get seed, seed+1, ...)", NATIVE_SAMPLING_TEST),
    "sampling_seed": honoured("an integer (SGLang's name of seed)", NATIVE_SAMPLING_TEST),
    "stream_interval": no_effect("an integer", "a stream sends every update; the text is the same"),
    "stop_regex": honoured(_STOP_REGEX, STOPS_TEST),
    "frequency_penalty": honoured("a number in [-2, 2] (times each output token's count)" + _IN_STEP, CONTROLS_TEST),
    "presence_penalty": honoured("a number in [-2, 2] (once per token in the output)" + _IN_STEP, CONTROLS_TEST),
    "repetition_penalty": honoured("a number in (0, 2] (over prompt and output tokens)" + _IN_STEP, CONTROLS_TEST),
    "min_new_tokens": honoured("an integer from 0 to max_new_tokens, beside at most 16 stop_token_ids: no eos, stop "
                               "id or stop string ends it before (in the verify too when speculating)",
                               MIN_TOKENS_TEST),
    "json_schema": honoured("a JSON schema (text or object)" + _GRAMMAR, GRAMMAR_FIELDS_TEST),
    "regex": honoured("a regular expression" + _GRAMMAR, GRAMMAR_FIELDS_TEST),
    "ebnf": honoured("a GBNF grammar" + _GRAMMAR, GRAMMAR_FIELDS_TEST),
    "structural_tag": refused("a structural tag"),
    "spaces_between_special_tokens": refused("true or false", True),
    "no_stop_trim": honoured(_NO_TRIM, STOPS_TEST),
    "custom_params": refused("an object for a custom logit processor", {}),
    "logit_bias": honoured("an object of up to 300 token id: bias in [-100, 100]" + _IN_STEP, CONTROLS_TEST),
}

# Per endpoint (and the objects inside one): its fields, and whether a key it does not list is refused (True) or
# accepted with a warning in the log (False); see docs/api.md for why.
TABLES: dict[str, tuple[dict[str, Field], bool]] = {
    "/v1/completions": (COMPLETIONS, False),
    "/v1/chat/completions": (CHAT, False),
    "/generate": (GENERATE, False),
    "sampling_params": (SAMPLING_PARAMS, True),
    "messages[]": (MESSAGE, False),
}


def markdown() -> str:
    """The table as docs/api.md shows it: one section per endpoint, one row per field."""
    out = []
    for name, (table, strict) in TABLES.items():
        unknown = "refused" if strict else "accepted, with a warning in the log"
        out += [f"### `{name}`", "", f"A field not listed here: {unknown}.", "",
                "| field | status | accepts | honoured by / why no effect / neutral values |",
                "| --- | --- | --- | --- |"]
        for field_name, f in sorted(table.items()):
            where = f"send {f.where}" if f.status is Status.REFUSED else f.where
            out.append(f"| `{field_name}` | {f.status.value} | {f.accepts.replace('|', '/')} | "
                       f"{where.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
