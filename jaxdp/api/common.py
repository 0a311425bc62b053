"""What the endpoints share: the JSON error shape, reading typed fields from a body, sampling parameters,
and turning a request's tokens into the text a client sees (stop strings cut, partial characters held).
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from jaxdp.engine.request import Request, SamplingParams

MAX_N = 16  # choices per request (n)


class ApiError(Exception):
    """An HTTP error with one sentence for the client; rendered as {"error": {message, type, code}}."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param


def error_response(message: str, status: int = 400, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


async def read_json(request: HttpRequest) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON ({e.msg if hasattr(e, 'msg') else e}); "
                       "send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = None, *, where: str = "") -> Any:
    """body[name] checked against `kind` (ints accepted where floats are; bools never count as numbers)."""
    value = body.get(name, default)
    if value is None or value is default:
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok:
        names = " or ".join(_type_name(k) for k in kinds)
        raise ApiError(f"{where}{name} must be {names}, got {json.dumps(value)[:60]}", param=name)
    return value


def _type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
            dict: "an object"}.get(kind, kind.__name__)


def sampling_params(sp: dict, *, max_new: int | None, where: str = "") -> SamplingParams:
    """SamplingParams from SGLang-style names; `max_new` is the default when the body gives none."""
    stop = field(sp, "stop", (str, list), where=where)
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"{where}stop must be a string or a list of non-empty strings", param="stop")
    stop_ids = field(sp, "stop_token_ids", list, where=where) or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ApiError(f"{where}stop_token_ids must be a list of integers", param="stop_token_ids")
    temperature = field(sp, "temperature", float, where=where)
    params = SamplingParams(
        max_new_tokens=field(sp, "max_new_tokens", int, max_new, where=where),
        temperature=1.0 if temperature is None else temperature,
        top_p=field(sp, "top_p", float, 1.0, where=where),
        top_k=field(sp, "top_k", int, -1, where=where),
        min_p=field(sp, "min_p", float, 0.0, where=where),
        seed=field(sp, "seed", int, where=where),
        stop=stop, stop_token_ids=stop_ids,
        ignore_eos=field(sp, "ignore_eos", bool, False, where=where),
    )
    if params.max_new_tokens is not None and params.max_new_tokens < 1:
        raise ApiError(f"{where}max_new_tokens must be at least 1, got {params.max_new_tokens}", param="max_tokens")
    return params


def check_length(params: SamplingParams, prompt_len: int, context_len: int) -> SamplingParams:
    """Fill in the default max_new_tokens (the rest of the context) and refuse what cannot fit."""
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


def check_n(n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise ApiError(f"n must be an integer from 1 to {MAX_N}, got {json.dumps(n)}", param="n")
    return n


def done_ids(req: Request) -> list[int]:
    """The request's output tokens read back so far (tokens still on the device are not shown)."""
    return list(req.done_ids)


class TextView:
    """The text of a request's output as a client sees it: decoded, cut before the first stop string,
    holding back a partial UTF-8 character and, while running, a tail that could begin a stop string."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.window = max((len(s) for s in stop), default=0) + 8
        self.matched: str | None = None

    def stop_check(self, req: Request) -> bool:
        """The engine's hook: True when the tail of the output contains a stop string."""
        tail = self.tokenizer.decode(done_ids(req)[-self.window:], skip_special_tokens=self.skip)
        return any(s in tail for s in self.stop)

    def text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(done_ids(req), skip_special_tokens=self.skip)
        cuts = [(text.find(s), s) for s in self.stop if s in text]
        if cuts:
            at, self.matched = min(cuts)
            return text[:at]
        if not req.finished:
            text = text.rstrip("\ufffd")
            if self.stop and self.hold:
                text = text[: max(0, len(text) - self.hold)]
        return text


def finish_reason(req: Request, view: TextView | None) -> dict[str, Any] | None:
    """SGLang's meta_info.finish_reason: {"type": "stop"|"length"|"abort", "matched"/"length"/"message"}."""
    if not req.finished:
        return None
    ids = done_ids(req)
    if req.finish_reason == "length":
        return {"type": "length", "length": len(ids)}
    if req.finish_reason == "abort":
        return {"type": "abort", "message": req.error or "the request was aborted"}
    if view is not None and view.matched is not None:
        return {"type": "stop", "matched": view.matched}
    return {"type": "stop", "matched": ids[-1] if ids else None}


def openai_finish(req: Request) -> str | None:
    if not req.finished:
        return None
    return {"stop": "stop", "length": "length"}.get(req.finish_reason or "", "abort")


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@contextlib.asynccontextmanager
async def watch_disconnect(http: HttpRequest, backend, rids: list[str]):
    """Abort `rids` if the client of a non-streaming request goes away before the answer is ready."""
    import asyncio

    async def watch():
        while True:
            await asyncio.sleep(0.25)
            if await http.is_disconnected():
                for rid in rids:
                    backend.abort(rid)
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
