"""The FastAPI app: `create_app(backend, ...)` over an Engine or a ReplicaSet.

Every endpoint but /health needs `Authorization: Bearer KEY` when the server has an API key. Every error
a client can cause is a 4xx JSON body {"error": {"message", "type", "param", "code"}} whose message is one
sentence; the server keeps serving, and the connection stays open. One function (`render_error`) turns
every exception an endpoint raises into that body; the guard (`jaxdp.api.guard`) does the same for what
escapes it.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxdp.api.common import ApiError
from jaxdp.api.context import ChatParsing, Limits, ServerContext
from jaxdp.api.experts import register_expert_metrics
from jaxdp.api.experts import router as experts_router
from jaxdp.api.guard import Guard, allowed_hosts
from jaxdp.api.metrics import ServerMetrics
from jaxdp.api.native import router as native_router
from jaxdp.api.openai_api import router as openai_router
from jaxdp.api.replicas import ReplicaSet
from jaxdp.api.tokenize import router as tokenize_router
from jaxdp.engine import BadRequest, Engine
from jaxdp.engine.loop import EngineFailed
from jaxdp.grammar import Grammars

log = logging.getLogger("jaxdp.serve")


def as_api_error(request: HttpRequest, e: Exception) -> ApiError:
    """The one mapping from an exception to the error a client sees."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, BadRequest):
        return ApiError(str(e))
    if isinstance(e, EngineFailed):
        return ApiError(f"{e}; this server no longer serves requests", 503, "server_error")
    if isinstance(e, RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return ApiError(f"{where or 'the request'}: {first.get('msg', 'is not valid')}")
    if isinstance(e, StarletteHTTPException) and e.status_code == 404:
        return ApiError(f"{request.url.path} is not an endpoint of this server; see /docs", 404, "not_found_error")
    if isinstance(e, StarletteHTTPException) and e.status_code == 405:
        return ApiError(f"{request.method} is not allowed on {request.url.path}", 405)
    if isinstance(e, StarletteHTTPException):
        return ApiError(str(e.detail), e.status_code)
    raise e  # not a client's error: the guard logs it and answers a JSON 500


async def render_error(request: HttpRequest, e: Exception):
    return as_api_error(request, e).response()


def create_app(backend: Engine | ReplicaSet, *, tokenizer=None, served_model_name: str = "default",
               model_path: str = "", server_args: dict[str, Any] | None = None, api_key: str | None = None,
               metrics: ServerMetrics | None = None, limits: Limits | None = None,
               bind: tuple[str, int] | None = None, parsing: ChatParsing | None = None,
               grammars: Grammars | None = None) -> FastAPI:
    """The app over `backend` (an Engine is wrapped in a one-engine ReplicaSet). Starts nothing. `bind`: the
    address the server listens on (a loopback one makes the app check the Host header); `parsing`: the chat
    output parsers (--tool-call-parser, --reasoning-parser); `grammars`: the grammar service that checks requests'
    grammars (--grammar-backend; None refuses them)."""
    if isinstance(backend, Engine):
        backend = ReplicaSet([backend], backend.cfg.load_balance_method)
    tokenizer = tokenizer if tokenizer is not None else backend.tokenizer
    app = FastAPI(title="jaxdp", description="OpenAI-compatible and SGLang-native serving of MLA + MoE models "
                  "with data-parallel attention", version="0.1.0")
    metrics = metrics or ServerMetrics(backend, served_model_name)
    ctx = ServerContext(backend, tokenizer, metrics, served_model_name, model_path, server_args or {}, api_key,
                        limits or Limits(), parsing or ChatParsing(), grammars=grammars)
    app.state.ctx = ctx
    app.add_middleware(Guard, ctx=ctx, hosts=allowed_hosts(*bind) if bind else None)
    for kind in (ApiError, BadRequest, EngineFailed, RequestValidationError, StarletteHTTPException):
        app.add_exception_handler(kind, render_error)
    app.include_router(native_router)
    app.include_router(openai_router)
    app.include_router(tokenize_router)
    app.include_router(experts_router)  # (the expert-distribution recorder, jaxdp.api.experts)
    register_expert_metrics(metrics, backend, ctx.server_args)
    return app
