"""The checks every HTTP request passes before an endpoint sees it, and the last resort after: one pure ASGI
middleware (nothing is buffered, so streamed answers flow through untouched).

In order: while the server binds a loopback address, the Host header must name it and an Origin header,
if any, must be a loopback page (so a web page cannot drive the server through DNS rebinding or a
cross-site form); during a graceful shutdown every request gets a 503; with --api-key every path but
/health needs the bearer key; a POST body must be `application/json` (415: a cross-site form cannot send
that without the browser asking first) and at most --max-request-bytes (413, from Content-Length before
anything is read, or as soon as a chunked body passes the limit). An exception that escapes an endpoint
becomes a JSON 500 here, and is not raised further, so the connection stays open for the next request.
"""

from __future__ import annotations

import hmac
import logging
from urllib.parse import urlsplit

from starlette.requests import ClientDisconnect

from jaxdp.api.common import ApiError

log = logging.getLogger("jaxdp.serve")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _TooLarge(Exception):
    pass


def allowed_hosts(bind_host: str, port: int) -> set[str] | None:
    """Host header values that name this server, or None when it binds a non-loopback address (then any
    name may reach it, and --api-key is what guards it)."""
    if bind_host not in LOOPBACK and not bind_host.startswith("127."):
        return None
    names = {bind_host, "127.0.0.1", "localhost", "[::1]"}
    names = {f"[{n}]" if ":" in n and not n.startswith("[") else n for n in names}
    return names | {f"{n}:{port}" for n in names}


class Guard:
    def __init__(self, app, ctx, hosts: set[str] | None = None):
        self.app, self.ctx, self.hosts = app, ctx, hosts
        self.key = f"Bearer {ctx.api_key}".encode() if ctx.api_key else None

    def check(self, scope) -> ApiError | None:
        headers = dict(scope["headers"])
        path, method = scope["path"], scope["method"]
        if self.hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host not in self.hosts:
                return ApiError(f"the Host header {host[:60]!r} does not name this server, which serves "
                                "127.0.0.1 only; send the request to the address the server binds", 421)
            origin = headers.get(b"origin")
            if origin is not None and urlsplit(origin.decode("latin-1")).netloc not in self.hosts:
                return ApiError("requests from web pages of other sites are refused while the server binds a "
                                "loopback address; call it from a program instead", 403, "permission_error")
        if self.ctx.draining:
            return ApiError("the server is shutting down; send the request to another server", 503, "server_error",
                            headers={"Retry-After": "5", "Connection": "close"})
        if self.key is not None and path != "/health" and not hmac.compare_digest(headers.get(b"authorization", b""),
                                                                                  self.key):
            return ApiError("the API key is missing or wrong; send the header 'Authorization: Bearer <key>' with "
                            "the server's --api-key", 401, "authentication_error")
        has_body = headers.get(b"content-length", b"0") not in (b"0", b"") or b"transfer-encoding" in headers
        if method in ("POST", "PUT", "PATCH") and has_body:
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                return ApiError(f"the request body must be JSON sent with 'Content-Type: application/json', got "
                                f"{kind.decode('latin-1')[:60] or 'no content type'!r}", 415)
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.ctx.limits.max_request_bytes):
                return self.too_large()
        return None

    def too_large(self) -> ApiError:
        limit = self.ctx.limits.max_request_bytes
        return ApiError(f"the request body is larger than the server's --max-request-bytes {limit}; send a "
                        "smaller request", 413, headers={"Connection": "close"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, seen, started = self.ctx.limits.max_request_bytes, 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400 and self.ctx.metrics is not None:
                    self.ctx.metrics.http_errors.labels(str(message["status"])).inc()
            await send(message)

        try:
            if (err := self.check(scope)) is not None:
                await err.response()(scope, receive, tracked_send)
            else:
                await self.app(scope, counted_receive, tracked_send)
        except ClientDisconnect:  # the client left while sending its body: no one to answer
            return
        except Exception as e:
            if started:  # the answer is under way (a stream): nothing else can be said on this connection
                raise
            if isinstance(e, _TooLarge):
                err = self.too_large()
            else:
                log.exception("internal error while serving %s %s", scope["method"], scope["path"])
                err = ApiError(f"internal server error ({type(e).__name__}); see the server log", 500,
                               "server_error")
            await err.response()(scope, receive, tracked_send)
