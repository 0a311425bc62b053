"""What the endpoints share: the JSON error shape, and turning a request's tokens into the text a client
sees (stop strings cut, partial characters held).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from jaxdp.engine.sched.request import Request, compile_stop_regexes

STOP_REGEX_HOLD = 32  # characters a running stream holds back when the request has stop_regex
STOP_REGEX_LOOKBACK = 256  # characters before the newest text where a stop_regex match may begin


class ApiError(Exception):
    """An HTTP error with one sentence for the client; rendered as {"error": {message, type, code}}."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.kind, self.param = message, status, kind, param
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status, self.kind, self.param, self.headers)


def error_response(message: str, status: int = 400, kind: str = "invalid_request_error",
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def done_ids(req: Request) -> list[int]:
    """The request's output tokens read back so far (tokens still on the device are not shown)."""
    return list(req.done_ids)


class TextView:
    """The text of a request's output as a client sees it: decoded, cut before the first stop string or stop_regex
    match (after it with `trim` False: SGLang's no_stop_trim), holding back a partial UTF-8 character and, while
    running, a tail that could begin a stop string (STOP_REGEX_HOLD characters with stop_regex: a stream has sent
    the text before that, so a match that begins further back is cut from the final text only).

    Decoded incrementally (as SGLang's detokenizer and vLLM's): each call decodes only the tokens since the
    text last became whole, with the token before them as context (so a tokenizer that drops a word's leading
    space at the start of a decode gives the same text as decoding everything), and looks for stop strings
    only where a new one can end. A token costs the same at the 10th output token as at the 10,000th."""

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True, stop_regex: list[str] = (),
                 trim: bool = True):
        self.tokenizer, self.stop, self.skip, self.trim = tokenizer, stop, skip_special_tokens, trim
        self.regexes = list(zip(stop_regex, compile_stop_regexes(list(stop_regex)), strict=True))
        self.hold = max([len(s) - 1 for s in stop] + ([STOP_REGEX_HOLD] if self.regexes else [0]))
        self.matched: str | None = None  # the stop string, or the stop_regex pattern, that ended the text
        self._text = ""  # the whole text of ids[:_read]
        self._prefix = self._read = 0  # ids[_prefix:_read] decode to the end of _text (the context)
        self._searched = 0  # _text[:_searched] holds no stop string
        self._cut: int | None = None  # where the first stop string begins

    def _advance(self, ids: list[int], final: bool) -> str:
        """The text of ids (a trailing partial character left out unless final)."""
        if self._read >= len(ids) and not final:
            return self._text
        decode = self.tokenizer.decode
        context = decode(ids[self._prefix:self._read], skip_special_tokens=self.skip) if self._read else ""
        text = decode(ids[self._prefix:], skip_special_tokens=self.skip)
        if not text.startswith(context):  # a tokenizer whose context decodes differently: decode it all
            text, context, self._text, self._prefix = decode(ids, skip_special_tokens=self.skip), "", "", 0
        new = text[len(context):]
        if final or not new.endswith("\ufffd"):  # whole: the next call starts from here
            self._text += new
            self._prefix, self._read = self._read, len(ids)
            return self._text
        return self._text + new.rstrip("\ufffd")

    def text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        if self._cut is not None:
            return self._text[: self._cut]
        text = self._advance(done_ids(req), req.finished)
        if self.stop or self.regexes:
            start = max(0, self._searched - self.hold)
            cuts = [(at, at + len(s), s) for s in self.stop if (at := text.find(s, start)) >= 0]
            back = max(0, self._searched - STOP_REGEX_LOOKBACK)
            cuts += [(m.start(), m.end(), p) for p, r in self.regexes if (m := r.search(text, back))]
            self._searched = len(text)
            if cuts:
                at, end, self.matched = min(cuts)
                self._cut = at if self.trim else end  # (no_stop_trim: the matched text stays)
                return text[: self._cut]
        if not req.finished:
            text = text.rstrip("\ufffd")
            if self.hold:
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
    if view is not None:
        view.text(req)  # (reading the text finds the stop string or pattern that cut it, whatever was read first)
        if view.matched is not None:
            return {"type": "stop", "matched": view.matched}
    return {"type": "stop", "matched": ids[-1] if ids else None}


def openai_finish(req: Request) -> str | None:
    if not req.finished:
        return None
    return {"stop": "stop", "length": "length"}.get(req.finish_reason or "", "abort")


_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def sse(data: Any) -> bytes:
    """One server-sent event (orjson: a token's event is encoded several times faster than by json)."""
    body = data.encode() if isinstance(data, str) else orjson.dumps(data, option=_JSON_OPTIONS)
    return b"data: " + body + b"\n\n"


@contextlib.asynccontextmanager
async def watch_disconnect(http: HttpRequest, backend, rids: list[str]):
    """Abort `rids` if the client of a non-streaming request goes away before the answer is ready."""

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
