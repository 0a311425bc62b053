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
from jaxdp.engine.request import SamplingParams

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


def integer(body: dict, name: str, default: int | None, lo: int, hi: int, *, where: str = "",
            param: str | None = None) -> int | None:
    """An integer field in [lo, hi] (the range of the array it fills, or a cap)."""
    value = field(body, name, int, default, where=where)
    if value is not None and not lo <= value <= hi:
        raise ApiError(f"{where}{name} must be an integer from {lo} to {hi}, got {_shown(value)}",
                       param=param or name)
    return value


def number(body: dict, name: str, default: float, lo: float, hi: float = FLOAT32_MAX, *, where: str = "",
           lo_open: bool = False) -> float:
    """A float field in [lo, hi] ((lo, hi] with lo_open) that stays finite and nonzero-where-asked in float32."""
    value = field(body, name, float, default, where=where)
    low_ok = value > lo if lo_open else value >= lo
    if lo_open and np.float32(value) <= lo:  # rounds to lo in the step's float32 array
        low_ok = False
    if not (low_ok and value <= hi):
        bracket = "(" if lo_open else "["
        raise ApiError(f"{where}{name} must be in {bracket}{lo:g}, {hi:g}], got {_shown(value)}", param=name)
    return value


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


def stop_strings(body: dict, *, where: str = "") -> list[str]:
    stop = field(body, "stop", (str, list), where=where)
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(f"{where}stop holds {len(stop)} strings, more than the {MAX_STOP} allowed", param="stop")
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in stop):
        raise ApiError(f"{where}stop must be a string or a list of strings of 1 to {MAX_STOP_LEN} characters",
                       param="stop")
    return stop


def sampling_params(sp: dict, *, max_new: int | None, vocab_size: int, where: str = "") -> SamplingParams:
    """SamplingParams from SGLang-style names; `max_new` is the default when the body gives none. The
    upper bound of max_new_tokens is the context length, which check_length applies once the rank is known."""
    stop_ids = field(sp, "stop_token_ids", list, where=where) or []
    temperature = number(sp, "temperature", 1.0, 0.0, where=where)
    return SamplingParams(
        max_new_tokens=integer(sp, "max_new_tokens", max_new, 1, INT32_MAX, where=where, param="max_tokens"),
        temperature=temperature,
        top_p=number(sp, "top_p", 1.0, 0.0, 1.0, where=where, lo_open=True),
        top_k=_top_k(sp, where),
        min_p=number(sp, "min_p", 0.0, 0.0, 1.0, where=where),
        seed=integer(sp, "seed", None, -(2**63), 2**64 - 1, where=where),
        stop=stop_strings(sp, where=where),
        stop_token_ids=int_list(stop_ids, "stop_token_ids", vocab_size, max_len=MAX_STOP_TOKEN_IDS, where=where),
        ignore_eos=field(sp, "ignore_eos", bool, False, where=where),
    )


def _top_k(sp: dict, where: str) -> int:
    top_k = field(sp, "top_k", int, -1, where=where)
    if top_k != -1 and not 1 <= top_k <= INT32_MAX:
        raise ApiError(f"{where}top_k must be -1 (all tokens) or an integer from 1 to {INT32_MAX}, got "
                       f"{_shown(top_k)}", param="top_k")
    return top_k


def check_n(body: dict, prompts: int) -> int:
    n = integer(body, "n", 1, 1, MAX_N)
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
