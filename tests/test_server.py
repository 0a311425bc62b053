"""`python -m jaxdp.serve` end to end on 8 CPU devices: the official openai client, /generate with pinning and
streaming, /metrics, bad requests, client disconnects, the controller (round_robin, total_tokens) and two
unequal replicas. Two servers are started once for the module (a dp=8 one with an API key, and a
`--dp-size 2` one with unequal pools and no tokenizer) and always stopped."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import time

import httpx
import pytest
from servers import Server, free_port

from jaxdp.model.loader import default_model_path

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
SMALL = ["--chunked-prefill-size", "64", "--max-running-requests", "32", "--cuda-graph-bs", "4",
         "--decode-log-interval", "5", "--page-size", "16"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    model = [] if HAVE_DEFAULT else ["--model-path", "tiny"]
    started = []
    try:
        main = Server([*model, "--mesh", "dp=8", "--max-total-tokens", "512", "--api-key", KEY, *SMALL],
                      tmp / "dp8.log")
        started.append(main)
        replicas = Server(["--model-path", "tiny", "--dp-size", "2", "--load-balance-method", "total_tokens",
                           "--replica-num-pages", "64,16", "--skip-tokenizer-init", *SMALL], tmp / "replicas.log")
        started.append(replicas)
        yield main.wait(), replicas.wait()
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def replica_server(servers):
    return servers[1]


def post(server, path, body, headers=AUTH, timeout=60):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def get(server, path, headers=AUTH):
    return httpx.get(server.url + path, headers=headers, timeout=30)


def sse_events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- the openai client ----------------------------------------------------------------------------


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)


def test_completions_with_the_openai_client(server):
    c = client(server)
    model = c.models.list().data[0].id
    prompt = "37+48=" if HAVE_DEFAULT else [5, 6, 7, 8]
    r = c.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    again = c.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic
    many = c.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=3, n=2, seed=7,
                                extra_body={"ignore_eos": True})
    assert len(many.choices) == 4 and many.usage.completion_tokens == 12
    chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


@pytest.mark.skipif(not HAVE_DEFAULT, reason="chat needs the default model's tokenizer")
def test_chat_and_streaming_with_the_openai_client(server):
    c = client(server)
    messages = [{"role": "user", "content": "37+48="}]
    r = c.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens > 5
    stream = c.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    stopped = c.chat.completions.create(model="default", messages=messages, max_tokens=20, temperature=0,
                                        stop=[text[:1]] if text else ["x"])
    assert stopped.choices[0].finish_reason == "stop"


# ---- /generate -----------------------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_DEFAULT, reason="a grammar needs the default model's tokenizer")
def test_structured_outputs_through_the_engine_process(server):
    """The default server (its engines in a child process, dp=8) serves grammars: a response_format's JSON
    validates with jsonschema, a forced tool call's arguments with its tool's schema (test_structured_outputs.py has
    the rest, in process)."""
    import jsonschema

    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"]}
    add = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                            "b": {"type": "integer", "minimum": 0, "maximum": 999}}}
    c = client(server)
    answer = c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Ada is 36."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), person)
    call = c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "37+48="}], max_tokens=48, temperature=0,
        tools=[{"type": "function", "function": {"name": "add", "parameters": add}}], tool_choice="required",
        parallel_tool_calls=False)
    assert call.choices[0].finish_reason == "tool_calls"
    (made,) = call.choices[0].message.tool_calls
    assert made.function.name == "add"
    jsonschema.validate(json.loads(made.function.arguments), add)


def test_generate_pins_ranks_and_streams(server):
    body = {"input_ids": [3, 4, 5, 6], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    assert post(server, "/generate", body | {"routed_dp_rank": 5}).json()["meta_info"]["dp_rank"] == 5
    assert post(server, "/generate", body | {"data_parallel_rank": 2}).json()["meta_info"]["dp_rank"] == 2
    out = post(server, "/generate", body, headers=AUTH | {"X-Data-Parallel-Rank": "3"}).json()
    assert out["meta_info"]["dp_rank"] == 3 and len(out["output_ids"]) == 6
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert out["meta_info"]["prompt_tokens"] == 4 and out["meta_info"]["completion_tokens"] == 6
    with httpx.stream("POST", server.url + "/generate", json=body | {"stream": True, "routed_dp_rank": 6},
                      headers=AUTH, timeout=60) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["meta_info"]["dp_rank"] == 6 for c in chunks)
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1]["output_ids"] == out["output_ids"]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative text
    logp = post(server, "/generate", body | {"return_logprob": True}).json()["meta_info"]["output_token_logprobs"]
    assert len(logp) == 6 and all(lp <= 0 for lp, _tok, _text in logp)


@pytest.mark.skipif(not HAVE_DEFAULT, reason="stop_regex needs the default model's tokenizer")
def test_stop_regex_and_no_stop_trim_through_the_engine_process(server):
    """SGLang's stop_regex stops a request in the engine child (its check runs there) and the text is cut before the
    match; with no_stop_trim the match stays. The default model answers 37+48= with digits."""
    sp = {"max_new_tokens": 12, "temperature": 0}
    whole = post(server, "/generate", {"text": "37+48=", "sampling_params": sp}).json()
    assert any(ch.isdigit() for ch in whole["text"]), whole["text"]
    cut = post(server, "/generate", {"text": "37+48=", "sampling_params": sp | {"stop_regex": r"\d"}}).json()
    kept = post(server, "/generate", {"text": "37+48=", "sampling_params": sp | {"stop_regex": [r"\d"],
                                                                               "no_stop_trim": True}}).json()
    first = next(i for i, ch in enumerate(whole["text"]) if ch.isdigit())
    assert cut["text"] == whole["text"][:first] and kept["text"] == whole["text"][: first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d"}
    assert len(cut["output_ids"]) < len(whole["output_ids"]) or whole["meta_info"]["finish_reason"]["type"] == "stop"
    bad = post(server, "/generate", {"text": "1", "sampling_params": {"stop_regex": "(?=a)"}})
    assert bad.status_code == 400 and "not a regular expression this server reads" in bad.json()["error"]["message"]


def test_round_robin_spreads_eight_requests_one_per_rank(server):
    async def run():
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as c:
            body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            rs = await asyncio.gather(*(c.post(server.url + "/generate", json=body) for _ in range(8)))
            return [r.json()["meta_info"]["dp_rank"] for r in rs]

    assert sorted(asyncio.run(run())) == list(range(8))


def test_client_disconnect_aborts_and_frees_pages(server):
    body = {"input_ids": list(range(10, 30)), "stream": True, "routed_dp_rank": 7,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, headers=AUTH, timeout=60) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i >= 4:
                break  # leave: the connection closes with the request unfinished
    for _ in range(60):
        state = get(server, "/get_server_info").json()["internal_states"][7]
        if state["num_reqs"] == 0:
            break
        time.sleep(0.25)
    assert state["num_reqs"] == 0
    assert state["free_pages"] + state["cached_pages"] == state["num_pages"]
    assert 'jaxdp:num_aborted_requests_total{dp_rank="7"} 1.0' in get(server, "/metrics").text


def test_native_endpoints(server):
    assert get(server, "/health", headers={}).status_code == 200  # no key needed
    assert get(server, "/health_generate").status_code == 200
    info = get(server, "/get_server_info").json()
    assert info["num_ranks"] == 8 and len(info["internal_states"]) == 8 and "api_key" not in info
    assert info["engines"][0]["compiles_in_steps"] == 0  # no request compiled anything after warm-up
    load = get(server, "/get_load").json()
    assert [x["dp_rank"] for x in load] == list(range(8))
    assert httpx.post(server.url + "/flush_cache", headers=AUTH).status_code in (200, 400)


def test_metrics_after_traffic(server):
    post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
    time.sleep(0.5)  # the monitor polls the step records
    text = get(server, "/metrics").text
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "token_usage", "gen_throughput",
                 "cache_hit_rate", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "dp_attention_rows", "gather_mode", "padding_ratio",
                 "dp_attention_token_imbalance_ratio", "dp_attention_idle_ranks", "step_device_wait_seconds_bucket",
                 "step_agreement_seconds_bucket",
                 "compiles_total"):
        assert f"jaxdp:{name}" in text, name
    assert 'jaxdp:num_running_reqs{dp_rank="7"}' in text
    log = server.log.read_text()
    assert "DP3] Prefill batch, #new-seq:" in log and "Decode batch, #running-req:" in log


BAD = [
    ("invalid JSON", "/generate", b"{not json", {}, 400, "not valid JSON"),
    ("no prompt", "/generate", {"sampling_params": {}}, {}, 400, "exactly one of text or input_ids"),
    ("no prompt", "/v1/completions", {"model": "m"}, {}, 400, "prompt is required"),
    ("no messages", "/v1/chat/completions", {"model": "m"}, {}, 400, "messages is required"),
    ("negative max_tokens", "/v1/completions", {"prompt": [1, 2], "max_tokens": -3}, {}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"prompt": [1, 2], "max_tokens": 10**9}, {}, 400, "context length"),
    ("negative temperature", "/v1/completions", {"prompt": [1, 2], "temperature": -0.5}, {}, 400, "temperature"),
    ("wrong type", "/v1/completions", {"prompt": [1, 2], "max_tokens": "ten"}, {}, 400, "max_tokens must be"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, {}, 400, "empty"),
    ("empty input_ids", "/generate", {"input_ids": []}, {}, 400, "empty"),
    ("prompt too long", "/generate", {"input_ids": [1] * 600}, {}, 400, "holds at most"),
    ("token outside vocab", "/generate", {"input_ids": [1, 10**6]}, {}, 400, "outside the vocabulary"),
    ("invalid rank", "/generate", {"input_ids": [1, 2], "routed_dp_rank": 8}, {}, 400, "out of range"),
    ("invalid header rank", "/generate", {"input_ids": [1, 2]}, {"X-Data-Parallel-Rank": "x"}, 400, "not an integer"),
    ("bad n", "/v1/completions", {"prompt": [1, 2], "n": 0}, {}, 400, "n must be"),
    ("wrong API key", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, "API key"),
    ("no API key", "/generate", {"input_ids": [1]}, {"Authorization": ""}, 401, "API key"),
    ("unknown endpoint", "/v2/nothing", {}, {}, 404, "not an endpoint"),
]


@pytest.mark.parametrize("what,path,body,headers,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_one_clear_sentence(server, what, path, body, headers, status, words):
    h = AUTH | headers
    if body is None:
        r = httpx.get(server.url + path, headers=h, timeout=30)
    elif isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers=h | {"Content-Type": "application/json"}, timeout=30)
    else:
        r = httpx.post(server.url + path, json=body, headers=h, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == status and err["type"]
    assert "\n" not in err["message"] and "Traceback" not in err["message"]
    ok = post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200  # and the server keeps serving


# ---- replicas, total_tokens, no tokenizer -----------------------------------------------------------


def test_no_tokenizer_serves_token_ids_and_refuses_text(replica_server):
    r = post(replica_server, "/generate", {"text": "hello"}, headers={})
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
    r = post(replica_server, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}, headers={})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] and r.json()["choices"][0]["text"] == ""


def test_total_tokens_sends_a_new_request_to_the_least_loaded_replica(replica_server):
    """While a long request holds tokens on one replica, a new one goes to the other. The long request runs in a
    thread; the new one is sent as soon as /get_load shows the long one running (a decode step of the tiny model
    takes about a millisecond: its 190 tokens last a fifth of a second). An attempt counts only when the long
    request was still running once the new one was answered; one that missed it (the poll too slow, the long one
    done first) is made again."""
    small = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    for busy, expected in ((0, 1), (1, 0)):
        long = {"input_ids": list(range(1, 60)), "routed_dp_rank": busy,
                "sampling_params": {"max_new_tokens": 190, "ignore_eos": True}}
        seen = []
        for _ in range(10):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                done = pool.submit(post, replica_server, "/generate", long, {})
                got = None
                while got is None and not done.done():
                    load = json.loads(get(replica_server, "/get_load", headers={}).text)
                    if load[busy]["num_running_reqs"]:
                        got = post(replica_server, "/generate", small, headers={}).json()["meta_info"]["dp_rank"]
                        if not done.done():
                            seen.append((got, load))
                assert done.result().status_code == 200
            if seen:
                break
        assert seen, "the long request was never seen running while the new one was routed"
        assert seen[0][0] == expected, seen[0][1]


def test_unequal_replicas_total_tokens_keeps_the_small_one_from_holding_the_queue(replica_server):
    """The guide's two-L4 experiment scaled down: pools of 64 and 16 pages; 24 requests at once, long enough
    (64 new tokens) that /get_load sees both replicas busy: with 24 the large replica could finish its share
    between two polls on a fast step, and the comparison below then read its queue as always empty."""
    body = {"input_ids": list(range(1, 41)), "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    queues = []

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.create_task(c.post(replica_server.url + "/generate", json=body)) for _ in range(24)]
            while not all(t.done() for t in tasks):
                queues.append([x["num_reqs"] for x in (await c.get(replica_server.url + "/get_load")).json()])
                await asyncio.sleep(0.1)
            return [t.result().json()["meta_info"]["dp_rank"] for t in tasks]

    ranks = asyncio.run(run())
    on_small = ranks.count(1)
    assert on_small <= 0.35 * len(ranks), ranks  # round_robin would put half there
    assert max(q[1] for q in queues) <= max(q[0] for q in queues)


# ---- the command line --------------------------------------------------------------------------------


def test_cli_help_and_user_errors():
    out = subprocess.run([sys.executable, "-m", "jaxdp.serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--load-balance-method" in out.stdout and "--mem-fraction-static" in out.stdout
    for args, words in ((["--dp-size", "2", "--attn-dp-size", "2"], "cannot be combined"),
                        (["--model-path", "/nonexistent/model"], "neither a checkpoint directory")):
        r = subprocess.run([sys.executable, "-m", "jaxdp.serve", "--port", str(free_port()), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("error: ") and words in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


# ---- the controller's bookkeeping, without a server ---------------------------------------------------


class _FakeEngine:
    """What ReplicaSet reads of an EngineClient: its ranks, their pools, context length, make_request."""

    def __init__(self, dp: int, pages: int):
        from types import SimpleNamespace

        self.layout = SimpleNamespace(dp=dp)
        self.context_len = 4096
        self.facts = SimpleNamespace(num_pages=pages, page_size=16)

    def make_request(self, ids, params, rid, rank, bootstrap=None):
        from jaxdp.engine import Request

        return Request(rid, ids, params)


def test_total_tokens_counts_requests_not_yet_admitted_and_weighs_pools():
    from jaxdp.api.replicas import ReplicaSet
    from jaxdp.engine import SamplingParams

    b = ReplicaSet([_FakeEngine(8, 64)], "total_tokens")
    sizes = [50, 10, 40, 5, 30, 20, 60, 45]
    for rank, n in enumerate(sizes):
        b.make_request(list(range(n)), SamplingParams(), rank=rank)
    assert b.make_request([1], SamplingParams()).dp_rank == 3  # the least-loaded rank, before any step ran
    burst = [b.make_request(list(range(100)), SamplingParams()).dp_rank for _ in range(8)]
    assert sorted(burst) == list(range(8))  # a burst spreads: each assignment counts the ones before it
    unequal = ReplicaSet([_FakeEngine(1, 64), _FakeEngine(1, 16)], "total_tokens")
    ranks = [unequal.make_request(list(range(64)), SamplingParams()).dp_rank for _ in range(20)]
    assert ranks.count(1) == 4  # in proportion to the pools (4:1), not one in two as round_robin
