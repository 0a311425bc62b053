"""The FastAPI app: `create_app(backend, ...)` over an Engine or a ReplicaSet.

Every endpoint but /health needs `Authorization: Bearer KEY` when the server has an API key. Every error
a client can cause is a 4xx JSON body {"error": {"message", "type", "param", "code"}} whose message is one
sentence; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxdp.api.common import ApiError, TextView, check_length, error_response
from jaxdp.api.metrics import ServerMetrics
from jaxdp.api.replicas import ReplicaSet
from jaxdp.engine import BadRequest, Engine, Request, SamplingParams
from jaxdp.engine.engine import EngineFailed

log = logging.getLogger("jaxdp.serve")


@dataclasses.dataclass
class Job:
    """One request of an HTTP call, with how its text is shown."""

    req: Request
    view: TextView
    prompt_index: int  # which prompt of the call (a batch, or n choices of one prompt)


@dataclasses.dataclass
class ServerContext:
    backend: ReplicaSet
    tokenizer: Any
    metrics: ServerMetrics
    served_model_name: str
    model_path: str
    server_args: dict[str, Any]
    api_key: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def encode(self, text: str, what: str = "text") -> list[int]:
        if self.tokenizer is None:
            raise ApiError(f"this server has no tokenizer (--skip-tokenizer-init, or the checkpoint has no "
                           f"tokenizer.json), so it cannot read {what}; send token ids (input_ids) instead")
        if not text:
            raise ApiError(f"the prompt is empty; send at least one character of {what}", param="prompt")
        return self.tokenizer.encode(text)

    def context_len(self, rank: int | None) -> int:
        b = self.backend
        if rank is not None and isinstance(rank, int) and 0 <= rank < b.num_ranks:
            return b.context_len(rank)
        return min(b.context_len(r) for r in range(b.num_ranks))

    def make_jobs(self, prompts: list[list[int]], params: list[SamplingParams], n: int, *, rank: int | None = None,
                  rids: list[str | None] | None = None, skip_special_tokens: bool = True) -> list[Job]:
        """n requests per prompt, made and checked before any is submitted; a refusal raises ApiError."""
        jobs: list[Job] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                if not ids:
                    raise ApiError("the prompt is empty; send at least one token", param="prompt")
                check_length(sp, len(ids), self.context_len(rank))
                if sp.stop and self.tokenizer is None:
                    raise ApiError("stop strings need a tokenizer, which this server does not have; use "
                                   "stop_token_ids instead", param="stop")
                for j in range(n):
                    p = dataclasses.replace(sp, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids))
                    if p.seed is not None and j:
                        p.seed += j  # n samples with one seed: different but reproducible
                    rid = rids[i] if rids else None
                    if rid is not None and n > 1:
                        rid = f"{rid}-{j}"
                    req = self.backend.make_request(ids, p, rid=rid, rank=rank)
                    view = TextView(self.tokenizer, p.stop, skip_special_tokens)
                    if p.stop:
                        req.stop_check = view.stop_check
                    jobs.append(Job(req, view, i))
        except BadRequest as e:
            for job in jobs:
                self.backend.discard(job.req)
            raise ApiError(str(e)) from None
        except ApiError:
            for job in jobs:
                self.backend.discard(job.req)
            raise
        return jobs


async def run_jobs(backend: ReplicaSet, jobs: list[Job]) -> AsyncIterator[int]:
    """Stream all jobs together; yields the index of the job that changed. Closing it aborts the rest."""
    queue: asyncio.Queue = asyncio.Queue()

    async def one(i: int, job: Job) -> None:
        try:
            async for _ in backend.stream(job.req):
                queue.put_nowait(i)
        finally:
            queue.put_nowait(-1)

    tasks = [asyncio.create_task(one(i, job)) for i, job in enumerate(jobs)]
    done = 0
    try:
        while done < len(jobs):
            i = await queue.get()
            if i < 0:
                done += 1
                continue
            yield i
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def job_error(job: Job) -> ApiError | None:
    """A request the engine refused or failed, as the error the client gets."""
    req = job.req
    if req.finish_reason == "abort" and req.error:
        status = req.error_status or (500 if req.error.startswith("internal") else 400)
        return ApiError(req.error, status, "server_error" if status >= 500 else "invalid_request_error")
    return None


async def complete_jobs(http, backend: ReplicaSet, jobs: list[Job]) -> None:
    """Run non-streamed jobs to the end (aborting them if the client goes away); raise the first error."""
    from jaxdp.api.common import watch_disconnect

    async with watch_disconnect(http, backend, [j.req.rid for j in jobs]):
        async for _ in run_jobs(backend, jobs):
            pass
    for job in jobs:
        if (err := job_error(job)) is not None:
            raise err


class ApiKeyMiddleware:
    """Pure ASGI (no buffering of streamed answers): every path but /health needs the bearer key."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                response = error_response("the API key is missing or wrong; send the header 'Authorization: "
                                          "Bearer <key>' with the server's --api-key", 401, "authentication_error")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(backend: Engine | ReplicaSet, *, tokenizer=None, served_model_name: str = "default",
               model_path: str = "", server_args: dict[str, Any] | None = None, api_key: str | None = None,
               metrics: ServerMetrics | None = None) -> FastAPI:
    """The app over `backend` (an Engine is wrapped in a one-engine ReplicaSet). Starts nothing."""
    from jaxdp.api import native, openai_api

    if isinstance(backend, Engine):
        backend = ReplicaSet([backend], backend.cfg.load_balance_method)
    tokenizer = tokenizer if tokenizer is not None else backend.tokenizer
    app = FastAPI(title="jaxdp", description="OpenAI-compatible and SGLang-native serving of MLA + MoE models "
                  "with data-parallel attention", version="0.1.0")
    ctx = ServerContext(backend, tokenizer, metrics or ServerMetrics(backend), served_model_name, model_path,
                        server_args or {}, api_key)
    app.state.ctx = ctx

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return error_response(e.message, e.status, e.kind, e.param)

    @app.exception_handler(BadRequest)
    async def bad_request(_request, e: BadRequest):
        return error_response(str(e))

    @app.exception_handler(EngineFailed)
    async def engine_failed(_request, e: EngineFailed):
        return error_response(f"{e}; this server no longer serves requests", 503, "server_error")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(f"{where or 'the request'}: {first.get('msg', 'is not valid')}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_response(f"{request.url.path} is not an endpoint of this server; see /docs", 404,
                                  "not_found_error")
        if e.status_code == 405:
            return error_response(f"{request.method} is not allowed on {request.url.path}", 405,
                                  "invalid_request_error")
        return error_response(str(e.detail), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        log.exception("internal error while serving a request")
        return error_response(f"internal server error ({type(e).__name__}); see the server log", 500,
                              "server_error")

    app.include_router(native.router)
    app.include_router(openai_api.router)
    return app
