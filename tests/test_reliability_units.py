"""Issue 18's server half without a server: the field checks (jaxdp.api.fields) at their boundaries, and the
guard middleware (jaxdp.api.guard) over a small app, in process through httpx's ASGI transport."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from bad_values import BAD_VALUES, CONTEXT
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter

from jaxdp.api.common import ApiError
from jaxdp.api.context import Limits
from jaxdp.api.fields import INT32_MAX, SAMPLING, check_length, check_n, parse_json, sampling_params
from jaxdp.api.guard import Guard, allowed_hosts


@pytest.mark.parametrize("raw,words", [
    (b"{", "not valid JSON"), (b"[1]", "JSON object"), (b"", "JSON object"), (b"\xff{}", "UTF-8"),
    (b'{"a": ' + b"1" * 5000 + b"}", "too many digits"), (b"[" * 20000, "nested too deeply"),
    (b'{"a": ["x", {"b": "\\ud800"}]}', "surrogate"), (b'{"\\udfff": 1}', "surrogate"),
])
def test_parse_json_refuses_in_one_sentence(raw, words):
    with pytest.raises(ApiError) as e:
        parse_json(raw)
    assert words in e.value.message and e.value.status == 400 and "\n" not in e.value.message


def test_parse_json_keeps_valid_unicode():
    assert parse_json(b'{"t": "\\ud83d\\ude00 \xc3\xa9"}') == {"t": "\U0001f600 é"}


GOOD = {"top_k": INT32_MAX, "seed": 2**64 - 1, "temperature": 0, "top_p": 1e-30, "min_p": 1, "max_new_tokens": 1,
        "stop": ["x" * 256] * 16, "stop_token_ids": [0, 511]}
BAD = [("top_k", INT32_MAX + 1), ("top_k", 0), ("top_k", -2), ("seed", 2**64), ("seed", -(2**63) - 1),
       ("temperature", -1e-9), ("temperature", 10**400), ("temperature", 1e39), ("top_p", 1e-50), ("top_p", 1.01),
       ("min_p", -0.1), ("max_new_tokens", 0), ("max_new_tokens", INT32_MAX + 1), ("stop", ["x"] * 17),
       ("stop", ["x" * 257]), ("stop", [""]), ("stop_token_ids", [512]), ("stop_token_ids", [-1]),
       ("temperature", True), ("top_k", 1.5), ("ignore_eos", 1)]


def test_sampling_params_at_their_bounds():
    p = sampling_params(GOOD, max_new=None, vocab_size=512)
    assert p.top_k == INT32_MAX and p.seed == 2**64 - 1 and len(p.stop) == 16
    for name, value in BAD:
        with pytest.raises(ApiError) as e:
            sampling_params(GOOD | {name: value}, max_new=None, vocab_size=512)
        assert name in e.value.message, (name, value, e.value.message)
    assert check_n({"n": 16}, 16) == 16
    for body, prompts in (({"n": 17}, 1), ({"n": 0}, 1), ({}, 257), ({"n": 2}, 129)):
        with pytest.raises(ApiError):
            check_n(body, prompts)


def test_a_huge_integer_is_a_number_where_a_float_is_asked():
    """2**64 is a finite float temperature (served, as SGLang does); past float32's range it is refused."""
    assert sampling_params({"temperature": 2**64}, max_new=1, vocab_size=512).temperature == 2.0**64
    for value in (2**200, 10**400):
        with pytest.raises(ApiError, match="temperature"):
            sampling_params({"temperature": value}, max_new=1, vocab_size=512)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(case=st.sampled_from(sorted(SAMPLING)).flatmap(lambda name: st.tuples(st.just(name), BAD_VALUES[name])))
def test_the_fuzz_generator_draws_only_what_the_parser_refuses(case):
    """The fuzz test's bad values come from the parser's own table (SAMPLING), so the two cannot drift apart."""
    name, value = case
    with pytest.raises(ApiError) as e:
        params = sampling_params({"max_new_tokens": 4} | {name: value}, max_new=None, vocab_size=512)
        check_length(params, prompt_len=1, context_len=CONTEXT)  # the fuzz server's context
    assert name in e.value.message or (name == "max_new_tokens" and "max_tokens" in e.value.message)


def call(app, method: str, path: str, **kw) -> httpx.Response:
    import asyncio

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8000") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


async def chunks():
    for _ in range(2):
        yield b" " * 800


def test_guard_answers_every_refusal_as_json():
    app = FastAPI()

    @app.post("/echo")
    async def echo(http: Request):
        return {"n": len(await http.body())}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    metrics = SimpleNamespace(http_errors=Counter("http_errors", "", ["status"], registry=CollectorRegistry()))
    ctx = SimpleNamespace(api_key=None, draining=False, limits=Limits(max_request_bytes=1024), metrics=metrics)
    app.add_middleware(Guard, ctx=ctx, hosts=allowed_hosts("127.0.0.1", 8000))  # as create_app mounts it
    guard = app
    js = {"Content-Type": "application/json"}
    assert call(guard, "POST", "/echo", content=b"{}", headers=js).json() == {"n": 2}
    cases = [
        (dict(content=b"{}", headers={"Content-Type": "text/plain"}), 415, "application/json"),
        (dict(content=b"{}"), 415, "no content type"),
        (dict(content=b" " * 2000, headers=js), 413, "--max-request-bytes"),
        (dict(content=chunks(), headers=js), 413, "--max-request-bytes"),  # no Content-Length: counted
        (dict(content=b"{}", headers=js | {"Host": "evil.example"}), 421, "Host header"),
        (dict(content=b"{}", headers=js | {"Origin": "https://evil.example"}), 403, "other sites"),
    ]
    for kw, status, words in cases:
        r = call(guard, "POST", "/echo", **kw)
        assert r.status_code == status and words in r.json()["error"]["message"], (kw, r.text)
    r = call(guard, "GET", "/boom")  # a bug: a JSON 500, not raised to the server (which would drop the connection)
    assert r.status_code == 500 and "RuntimeError" in r.json()["error"]["message"]
    ctx.api_key = "k"
    app.middleware_stack = None  # rebuilt on the next call, with the key
    assert call(guard, "POST", "/echo", content=b"{}", headers=js).status_code == 401
    assert call(guard, "POST", "/echo", content=b"{}", headers=js | {"Authorization": "Bearer k"}).status_code == 200
    ctx.draining = True
    r = call(guard, "POST", "/echo", content=b"{}", headers=js | {"Authorization": "Bearer k"})
    assert r.status_code == 503 and r.headers["Retry-After"] == "5"
    samples = metrics.http_errors.collect()[0].samples
    counted = {s.labels["status"]: s.value for s in samples if s.name.endswith("total")}
    assert counted == {"415": 2, "413": 2, "421": 1, "403": 1, "500": 1, "401": 1, "503": 1}


def test_allowed_hosts():
    assert "localhost:30000" in allowed_hosts("127.0.0.1", 30000) and "[::1]:30000" in allowed_hosts("::1", 30000)
    assert allowed_hosts("0.0.0.0", 30000) is None


def test_server_limits_from_flags():
    from jaxdp.serve import UserError, build_parser, server_limits

    parse = build_parser().parse_args
    limits = server_limits(parse(["--max-request-bytes", "4096", "--max-queued-requests", "3", "--request-timeout",
                                  "2.5", "--graceful-shutdown-timeout", "7"]))
    assert limits == Limits(4096, 3, 2.5, 7.0)
    assert server_limits(parse([])) == Limits()  # the defaults: 16 MiB, no queue limit, no timeout, 30 s
    for flag, value in (("--max-request-bytes", "10"), ("--max-queued-requests", "0"), ("--request-timeout", "-1"),
                        ("--graceful-shutdown-timeout", "0")):
        with pytest.raises(UserError, match=f"^{flag} must be at least"):
            server_limits(parse([flag, value]))
