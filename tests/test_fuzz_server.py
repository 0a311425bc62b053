"""Issue 18's fuzz test: 200 seeded malformed bodies (hypothesis, derandomized) across the endpoints of a live
dp=8 server. Every answer is a 4xx JSON error whose message is one sentence, never a 5xx; meanwhile
unrelated greedy streams run one after another and each ends with the tokens it has alone; afterwards
the server is healthy and every page is back in the pools."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from bad_values import BAD_VALUES, REQUEST, junk, outside, surrogate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import Server
from test_reliability import HAVE_DEFAULT, SMALL, one_sentence, sse_events
from test_reliability_soak import run_soak

pytestmark = pytest.mark.skipif(not HAVE_DEFAULT, reason="the tests read text through the default model")
EXAMPLES = 200

PROMPT_BAD = (st.just("") | st.just([]) | surrogate | st.lists(st.integers(min_value=512), min_size=1, max_size=4)
              | st.lists(st.integers(max_value=-1), min_size=1, max_size=4) | st.integers() | st.booleans()
              | st.lists(st.floats(allow_nan=False), min_size=1, max_size=3))
MESSAGES_BAD = (st.just([]) | st.text(max_size=5) | st.lists(st.integers(), min_size=1, max_size=2)
                | st.lists(st.fixed_dictionaries({"role": st.integers(), "content": st.text()}), min_size=1)
                | st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.integers() | surrogate}),
                           min_size=1, max_size=2)
                | st.lists(st.fixed_dictionaries({"role": st.just("wizard"), "content": st.just("x")}), min_size=1,
                           max_size=1))
RAW_BAD = st.sampled_from([b"{", b"", b"[]", b"null", b"42", b'"x"', b"\xff\xfe{}", b'{"text": "a"', b"{'a': 1}",
                           b"[" * 5000, b'{"text": "ab", "x": ' + b"7" * 5000 + b"}", b'{"text": NaN}',
                           b'{"text": "a", "sampling_params": {"temperature": Infinity}}'])


@st.composite
def cases(draw) -> tuple[str, bytes]:
    """(path, body): a valid body with one field made invalid, or a body that is not a JSON object at all."""
    kind = draw(st.sampled_from(["generate", "completions", "chat", "raw", "abort"]))
    if kind == "raw":
        path = draw(st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]))
        return path, draw(RAW_BAD)
    if kind == "abort":
        body = draw(st.sampled_from([{}, {"rid": ""}]) | st.fixed_dictionaries({"rid": junk.filter(
            lambda v: not isinstance(v, str))}) | st.fixed_dictionaries({"abort_all": st.text() | st.integers()}))
        return "/abort_request", json.dumps(body).encode()
    name = draw(st.sampled_from([*BAD_VALUES, "prompt", "rank", "stream", "logprobs"]))
    value = draw({"prompt": PROMPT_BAD, "rank": st.integers(min_value=8) | st.integers(max_value=-1) | junk,
                  "stream": st.integers() | st.text(), "logprobs": outside(REQUEST["logprobs"]),
                  **BAD_VALUES}[name])
    if kind == "generate":
        body: dict = {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}}
        key = {"prompt": "text" if isinstance(value, str) else "input_ids", "rank": "routed_dp_rank",
               "logprobs": "return_logprob"}.get(name, name)
        if name in BAD_VALUES:
            body["sampling_params"][name] = value
        else:
            if key == "input_ids":
                del body["text"]
            if key == "return_logprob" and isinstance(value, bool):
                value = "yes"
            body[key] = value
        return "/generate", json.dumps(body).encode()
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    body = {"prompt": "1+1="} if kind == "completions" else {"messages": [{"role": "user", "content": "1+1="}]}
    body["max_tokens"] = 2
    key = {"rank": "routed_dp_rank", "max_new_tokens": "max_tokens"}.get(name, name)
    if name == "prompt":
        key, value = ("prompt", value) if kind == "completions" else ("messages", draw(MESSAGES_BAD))
    if name == "logprobs" and kind == "chat":
        value = draw(st.integers() | st.text())  # chat logprobs is a bool
    body[key] = value
    return path, json.dumps(body).encode()


@pytest.fixture(scope="module", params=[pytest.param([], id="engine-process"),  # and (-m slow) in one process
                                        pytest.param(["--no-engine-process"], id="one-process",
                                                     marks=pytest.mark.slow)])
def server(request, tmp_path_factory):
    s = Server(["--mesh", "dp=8", "--max-total-tokens", "512", "--max-request-bytes", "65536", *SMALL,
                *request.param], tmp_path_factory.mktemp("fuzz") / "server.log")
    try:
        yield s.wait()
    finally:
        s.stop()


def test_fuzz_malformed_bodies_get_one_sentence_and_cost_nobody_else(server):
    body = {"text": "123+456=", "routed_dp_rank": 3, "stream": True,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    solo = httpx.post(server.url + "/generate", json=body | {"stream": False}, timeout=60).json()["output_ids"]
    stop, streams = threading.Event(), []

    def unrelated() -> None:  # one greedy stream after another while the fuzzing goes on
        while not stop.is_set():
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
                streams.append(sse_events(r))

    runner = threading.Thread(target=unrelated)
    runner.start()
    seen: list[int] = []
    with httpx.Client(base_url=server.url, timeout=30) as c:

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases())
        def one(case: tuple[str, bytes]) -> None:
            path, raw = case
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code < 500, (path, raw[:200], r.text)
            one_sentence(r)
            seen.append(r.status_code)

        try:
            one()
        finally:
            stop.set()
            runner.join(timeout=120)
    assert len(seen) >= EXAMPLES
    assert streams and all(s[-1] == "[DONE]" and s[-2]["output_ids"] == solo for s in streams), streams[-1][-2:]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    states = httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"]
    assert all(s["num_reqs"] == 0 and s["free_pages"] + s["cached_pages"] == s["num_pages"] for s in states)


def test_soak_small(server):
    """The soak's CI sibling (the full one: test_reliability_soak.py, -m slow): 200 requests at 32."""
    tally = run_soak(server, total=200, concurrency=32, seed=7)
    assert tally.aborted > 5 and tally.refused > 0
