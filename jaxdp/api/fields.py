"""Reading a request body: JSON into a dict, and every field checked where it is read, ranges included.

A value that passes here cannot break a step: integers fit the int32 arrays they fill, floats are finite in
float32, and the lists a request may carry (prompts, n choices, stop strings, stop token ids) are capped.
Each refusal is an ApiError with one sentence that names the field and what to send instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from jaxdp.api.common import ApiError
from jaxdp.api.field_table import TABLES, Status
from jaxdp.engine.sched.request import MAX_LOGPROB_TOKEN_IDS, BadRequest, SamplingParams, compile_stop_regexes

MAX_N = 16  # choices per request (n)
MAX_PROMPTS = 256  # prompts in one batched request
MAX_JOBS = 256  # prompts x n in one request
MAX_STOP = 16  # stop strings
MAX_STOP_LEN = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_RID_LEN = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's range for chat top_logprobs (completions: logprobs 0..5)
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; a body Python's json cannot read, or holding text that is not valid Unicode
    (a lone UTF-16 surrogate such as \\ud800), is refused here rather than deep in the tokenizer."""
    try:
        body = json.loads(raw) if raw else None
    except UnicodeDecodeError:
        raise ApiError("the request body is not valid UTF-8; send JSON encoded as UTF-8") from None
    except json.JSONDecodeError as e:
        raise ApiError(f"the request body is not valid JSON ({e.msg} at character {e.pos}); send a JSON object"
                       ) from None
    except ValueError:  # an integer of more than 4300 digits (Python's int-from-string limit)
        raise ApiError("the request body holds a number with too many digits; send numbers of at most 4300 "
                       "digits") from None
    except RecursionError:
        raise ApiError("the request body is nested too deeply; send a flatter JSON object") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_unicode(body)
    return body


def _check_unicode(value: Any) -> None:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError("the request body holds a string with a lone UTF-16 surrogate (such as \\ud800), "
                               "which is not text; send valid Unicode") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(x for x in v if isinstance(x, str | list | dict))


def check_fields(body: dict, table: str, *, where: str = "") -> list[str]:
    """Check `body` against its endpoint's (or object's) row of the field table (`jaxdp.api.field_table`): a
    field jaxdp does not serve, carrying a value that would change the output, or an honoured field carrying a
    value it does not serve (tool_choice "required"), is refused in one sentence naming it. Returns the keys the
    table does not list (a table that refuses them has raised already), for the caller to log."""
    fields, strict = TABLES[table]
    unknown = []
    for name, value in body.items():
        f = fields.get(name)
        if f is None:
            unknown.append(name)
        elif f.status is Status.REFUSED and not f.is_neutral(value):
            raise ApiError(f"{where}{name} is not supported by this server yet; leave it out or send {f.where}",
                           param=name)
        elif f.refusal is not None and value is not None and (why := f.refusal(value)) is not None:
            raise ApiError(f"{where}{name} {why}", param=name)
    if strict and unknown:
        raise ApiError(f"{where}{unknown[0][:60]} is not a field this server knows; leave it out (docs/api.md "
                       "lists the fields it takes)", param=unknown[0][:60])
    return unknown


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
            dict: "an object"}.get(kind, kind.__name__)


def field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None, *, where: str = "") -> Any:
    """body[name] checked against `kind` (ints accepted where floats are; bools never count as numbers)."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if float in kinds and is_int:
        try:
            value = float(value)
        except OverflowError:
            raise ApiError(f"{where}{name} is out of range, got {_shown(value)}", param=name) from None
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok:
        names = " or ".join(_type_name(k) for k in kinds)
        raise ApiError(f"{where}{name} must be {names}, got {_shown(value)}", param=name)
    return value


@dataclasses.dataclass(frozen=True)
class Range:
    """What a numeric field accepts: its JSON kind (`int`, or `float` for any number), the range [lo, hi]
    ((lo, hi] with lo_open, where lo must not round to lo in the step's float32 array), and single values
    allowed outside it (top_k's -1). `accepts` is the rule; `check` refuses what it does not accept."""

    kind: type
    lo: float
    hi: float
    lo_open: bool = False
    also: tuple[int, ...] = ()

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and (self.kind is int or not math.isfinite(value)):
            return False
        if value in self.also:
            return True
        if self.kind is float:
            try:
                value = float(value)  # a JSON integer is a number too, as long as a float can hold it
            except OverflowError:
                return False
        if not (value > self.lo if self.lo_open else value >= self.lo) or value > self.hi:
            return False
        return not (self.lo_open and np.float32(value) <= self.lo)  # rounds to lo in the step's float32 array

    def describe(self) -> str:
        if self.kind is int:
            text = f"an integer from {self.lo} to {self.hi}"
            return " or ".join([*map(str, self.also), text]) if self.also else text
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, body: dict, name: str, default: Any, *, where: str = "", param: str | None = None) -> Any:
        """body[name], or `default` when absent; a value of the wrong type, or outside the range, is refused."""
        value = field(body, name, self.kind, default, where=where)
        if value is not None and not self.accepts(value):
            raise ApiError(f"{where}{name} must be {self.describe()}, got {_shown(value)}", param=param or name)
        return value


# What each numeric field of a request accepts, written once: the parsers read through these, and the fuzz test
# (tests/test_fuzz_server.py) draws its invalid values from them.
SAMPLING = {
    "max_new_tokens": Range(int, 1, INT32_MAX),  # and at most the room its rank's context leaves (check_length)
    "temperature": Range(float, 0.0, FLOAT32_MAX),
    "top_p": Range(float, 0.0, 1.0, lo_open=True),
    "top_k": Range(int, 1, INT32_MAX, also=(-1,)),  # -1: all tokens
    "min_p": Range(float, 0.0, 1.0),
    "seed": Range(int, -(2**63), 2**64 - 1),
    "min_new_tokens": Range(int, 0, INT32_MAX),  # and at most max_new_tokens (SamplingParams.validate)
}
REQUEST = {
    "n": Range(int, 1, MAX_N),
    "logprobs": Range(int, 0, 5),  # completions: alternatives per token (OpenAI's range)
    "top_logprobs": Range(int, 0, MAX_TOP_LOGPROBS),  # chat
}


def int_list(value: Any, name: str, hi: int, *, max_len: int, where: str = "") -> list[int]:
    """A list of integers from 0 to hi - 1 (token ids), at most max_len of them (checked first)."""
    if not isinstance(value, list):
        raise ApiError(f"{where}{name} must be a list of integers", param=name)
    if len(value) > max_len:
        raise ApiError(f"{where}{name} holds {len(value)} entries, more than the {max_len} allowed", param=name)
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool):
            raise ApiError(f"{where}{name} must hold integers, got {_shown(t)}", param=name)
        if not 0 <= t < hi:
            raise ApiError(f"{where}{name} holds {_shown(t)}, outside the vocabulary (0..{hi - 1})", param=name)
    return value


def token_ids(value: Any, name: str, vocab_size: int, context_len: int) -> list[int]:
    """A prompt as token ids; its length is checked against the context first, before each id is read."""
    if isinstance(value, list) and len(value) >= context_len:
        raise ApiError(f"the prompt has {len(value)} tokens but a rank holds at most {context_len} (context "
                       "length / KV pool); shorten the prompt", param=name)
    return int_list(value, name, vocab_size, max_len=context_len)


def stop_strings(body: dict, *, where: str = "", name: str = "stop") -> list[str]:
    stop = field(body, name, (str, list), where=where)
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(f"{where}{name} holds {len(stop)} strings, more than the {MAX_STOP} allowed", param=name)
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in stop):
        raise ApiError(f"{where}{name} must be a string or a list of strings of 1 to {MAX_STOP_LEN} characters",
                       param=name)
    return stop


def stop_regexes(body: dict, *, where: str = "") -> list[str]:
    """SGLang's stop_regex: as stop, each one a pattern RE2 reads."""
    patterns = stop_strings(body, where=where, name="stop_regex")
    try:
        compile_stop_regexes(patterns)
    except BadRequest as e:
        raise ApiError(f"{where}{e}", param="stop_regex") from None
    return patterns


def sampling_params(sp: dict, *, max_new: int | None, vocab_size: int, where: str = "") -> SamplingParams:
    """SamplingParams from SGLang-style names; `max_new` is the default when the body gives none. The
    upper bound of max_new_tokens is the context length, which check_length applies once the rank is known."""
    stop_ids = field(sp, "stop_token_ids", list, where=where) or []
    seed = SAMPLING["seed"].check(sp, "seed", None, where=where)
    sglang_seed = SAMPLING["seed"].check(sp, "sampling_seed", None, where=where)  # SGLang's name of it
    if seed is not None and sglang_seed is not None and seed != sglang_seed:
        raise ApiError(f"{where}seed and {where}sampling_seed differ; send one of them", param="seed")
    return SamplingParams(
        max_new_tokens=SAMPLING["max_new_tokens"].check(sp, "max_new_tokens", max_new, where=where,
                                                         param="max_tokens"),
        temperature=SAMPLING["temperature"].check(sp, "temperature", 1.0, where=where),
        top_p=SAMPLING["top_p"].check(sp, "top_p", 1.0, where=where),
        top_k=SAMPLING["top_k"].check(sp, "top_k", -1, where=where),
        min_p=SAMPLING["min_p"].check(sp, "min_p", 0.0, where=where),
        seed=seed if seed is not None else sglang_seed,
        stop=stop_strings(sp, where=where),
        stop_token_ids=int_list(stop_ids, "stop_token_ids", vocab_size, max_len=MAX_STOP_TOKEN_IDS, where=where),
        ignore_eos=field(sp, "ignore_eos", bool, False, where=where),
        min_new_tokens=SAMPLING["min_new_tokens"].check(sp, "min_new_tokens", 0, where=where),
        stop_regex=stop_regexes(sp, where=where),
        no_stop_trim=field(sp, "no_stop_trim", bool, False, where=where),
    )


def check_n(body: dict, prompts: int) -> int:
    n = REQUEST["n"].check(body, "n", 1)
    if prompts > MAX_PROMPTS:
        raise ApiError(f"the request holds {prompts} prompts, more than the {MAX_PROMPTS} allowed; split it",
                       param="prompt")
    if prompts * n > MAX_JOBS:
        raise ApiError(f"{prompts} prompts times n={n} make {prompts * n} choices, more than the {MAX_JOBS} "
                       "allowed; split the request", param="n")
    return n


def check_length(params: SamplingParams, prompt_len: int, context_len: int) -> SamplingParams:
    """A copy of `params` with the default max_new_tokens filled in (the rest of this prompt's context), or a
    refusal of what cannot fit; `params` itself is not changed (several prompts may share it)."""
    params = dataclasses.replace(params)
    room = context_len - prompt_len
    if room < 1:
        raise ApiError(f"the prompt has {prompt_len} tokens but a rank holds at most {context_len} "
                       "(context length / KV pool); shorten the prompt", param="prompt")
    if params.max_new_tokens is None:
        params.max_new_tokens = room
    elif params.max_new_tokens > room:
        raise ApiError(f"max_tokens {params.max_new_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                       f"context length of {context_len}; ask for at most {room} new tokens", param="max_tokens")
    return params


def rids(body: dict, prompts: int) -> list[str | None] | None:
    rid = field(body, "rid", (str, list))
    out = rid if isinstance(rid, list) else [rid] if rid is not None else None
    if out is not None and (len(out) != prompts or not all(isinstance(r, str) and 0 < len(r) <= MAX_RID_LEN
                                                            for r in out)):
        raise ApiError(f"rid must be a string of 1 to {MAX_RID_LEN} characters (or one such string per prompt)",
                       param="rid")
    return out


# ---- logprobs beyond the sampled token (prompt logprobs, chosen token ids) ------------------------------------

LOGPROBS = {
    "logprob_start_len": Range(int, -1, INT32_MAX),  # SGLang: -1, no prompt logprobs; past the prompt: the engine's
    "top_logprobs_num": Range(int, 0, MAX_TOP_LOGPROBS),  # SGLang: alternatives per position, prompt and output
    "prompt_logprobs": Range(int, 0, MAX_TOP_LOGPROBS),  # vLLM (completions): alternatives per prompt position
    "echo_max_tokens": Range(int, 0, INT32_MAX),  # completions' max_tokens with echo: 0 reads the prompt only
}


def echo_max_tokens(body: dict) -> int | None:
    """max_tokens of a completions request with echo: 0 is allowed (the prompt's logprobs alone, as vLLM)."""
    return LOGPROBS["echo_max_tokens"].check(body, "max_tokens", None)


def logprob_start_len(body: dict, prompt_logprobs: bool) -> int:
    """SGLang's logprob_start_len: the first prompt position whose logprob is returned (-1: none). The check
    against the prompt's length is the engine's (`jaxdp.engine.sched.request.new_request`)."""
    start = LOGPROBS["logprob_start_len"].check(body, "logprob_start_len", -1)
    if start >= 0 and not prompt_logprobs:
        raise ApiError("logprob_start_len needs return_logprob: true", param="logprob_start_len")
    return start


def top_logprobs_num(body: dict, name: str = "top_logprobs_num") -> int:
    """Alternatives per position (SGLang's top_logprobs_num, vLLM's prompt_logprobs), 0 to MAX_TOP_LOGPROBS."""
    return LOGPROBS[name].check(body, name, 0) or 0


def token_ids_logprob(body: dict, vocab_size: int) -> list[int] | None:
    """SGLang's token_ids_logprob: token ids whose logprobs are returned at every position that has logprobs."""
    ids = field(body, "token_ids_logprob", list)
    if ids is None:
        return None
    return int_list(ids, "token_ids_logprob", vocab_size, max_len=MAX_LOGPROB_TOKEN_IDS) or None


def prompt_logprobs_field(body: dict, stream: bool) -> int | None:
    """vLLM's prompt_logprobs (completions): None when absent, else the alternatives per prompt position."""
    if body.get("prompt_logprobs") is None:
        return None
    if stream:
        raise ApiError("prompt_logprobs is not supported with stream: true; send stream: false",
                       param="prompt_logprobs")
    return top_logprobs_num(body, "prompt_logprobs")
