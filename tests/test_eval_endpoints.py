"""What evaluation tools and dashboards read from a live server (default model, dp=8): the prompt's logprobs
through OpenAI's echo, vLLM's prompt_logprobs and SGLang's native fields (one computation, three layouts); the
tokenizer endpoints lm-evaluation-harness's remote tokenizer reads; the refusals of what cannot be served;
SGLang's metric names with values; and figures that agree with a flush the moment it answers. The numbers
themselves are checked against one_batch in test_prompt_logprobs.py, and lm-eval itself runs in test_lm_eval.py."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
from servers import Server

from jaxdp.api.sglang_metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from jaxdp.model.loader import default_model_path

HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
SMALL = ["--chunked-prefill-size", "64", "--max-running-requests", "32", "--cuda-graph-bs", "4",
         "--page-size", "4", "--max-total-tokens", "1024"]
pytestmark = pytest.mark.skipif(not HAVE_DEFAULT, reason="needs the embedded default model (text prompts)")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    server = Server(["--mesh", "dp=8", *SMALL], tmp_path_factory.mktemp("eval") / "server.log")
    try:
        yield server.wait().url
    finally:
        server.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_echo_returns_the_tokens_the_server_used_and_the_same_logprobs_everywhere(url):
    text = "37+48="
    ids = post(url, "/tokenize", {"prompt": text})
    assert ids.status_code == 200, ids.text
    ids = ids.json()["tokens"]
    info = httpx.get(url + "/tokenizer_info").json()
    assert ids[0] == info["bos_token_id"]  # the BOS the server adds to a text prompt
    r = post(url, "/v1/completions", {"prompt": text, "max_tokens": 1, "logprobs": 1, "echo": True,
                                      "temperature": 0}).json()
    lp = r["choices"][0]["logprobs"]
    assert r["choices"][0]["text"].startswith(text)
    n = len(ids)
    assert len(lp["tokens"]) == n + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:n] == [post(url, "/detokenize", {"tokens": [t]}).json()["prompt"] for t in ids]
    echoed = lp["token_logprobs"][1:n]
    assert all(isinstance(x, float) and x <= 0 for x in echoed)
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert max(top.values()) >= value - 1e-6  # lm-eval's is_greedy reads this

    # max_tokens 0 with echo: the prompt alone; vLLM's prompt_logprobs; SGLang's input_token_logprobs: the same
    zero = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0,
                                         "prompt_logprobs": 2}).json()
    assert zero["usage"]["completion_tokens"] == 0
    zero = zero["choices"][0]
    assert zero["logprobs"]["token_logprobs"][0] is None and len(zero["logprobs"]["tokens"]) == n
    np.testing.assert_allclose(zero["logprobs"]["token_logprobs"][1:], echoed, atol=1e-5)
    vllm = zero["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == n
    np.testing.assert_allclose([vllm[i][str(t)]["logprob"] for i, t in enumerate(ids) if i], echoed, atol=1e-5)
    assert all(sum(1 for e in d.values() if e["rank"] in (1, 2)) == 2 for d in vllm[1:])
    native = post(url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                                     "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2,
                                     "token_ids_logprob": [ids[3]]}).json()["meta_info"]
    np.testing.assert_allclose([x[0] for x in native["input_token_logprobs"]], echoed[1:], atol=1e-5)
    assert [x[1] for x in native["input_token_logprobs"]] == ids[2:]
    assert len(native["input_top_logprobs"]) == n - 2 and all(len(t) == 2 for t in native["input_top_logprobs"])
    assert abs(native["input_token_ids_logprobs"][1][0][0] - echoed[2]) < 1e-5  # position 3 asked about itself
    assert len(native["output_token_logprobs"]) == 2 == len(native["output_token_ids_logprobs"])
    assert lp["text_offset"][:3] == [0, 0, 1]  # into the text, where the BOS takes no characters
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "6*7="}], "max_tokens": 1,
                                              "prompt_logprobs": 0, "logprobs": True, "top_logprobs": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == 7
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1


def test_tokenizer_endpoints_speak_vllms_shapes(url):
    info = httpx.get(url + "/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    served = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    assert info["model_max_length"] == served and "{{ bos_token }}" in info["chat_template"]
    plain = post(url, "/tokenize", {"prompt": "6*7=", "add_special_tokens": False}).json()
    special = post(url, "/tokenize", {"prompt": "6*7=", "return_token_strs": True}).json()
    assert special["tokens"] == [info["bos_token_id"], *plain["tokens"]] and special["count"] == 5
    assert special["token_strs"] == ["<bos>", "6", "*", "7", "="] and special["max_model_len"] == served
    assert post(url, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": "6*7="}
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "6*7="}]}).json()["tokens"]
    assert chat[0] == info["bos_token_id"] and len(chat) == 7  # <bos><|user|>6*7=<|assistant|>
    assert post(url, "/tokenize", {"prompt": 5}).status_code == 400


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/completions", {"prompt": "1+1=", "echo": True, "logprobs": 1, "stream": True}, "echo is not supported"),
    ("/v1/completions", {"prompt": "1+1=", "prompt_logprobs": 1, "n": 2}, "prompt_logprobs needs n: 1"),
    ("/v1/completions", {"prompt": "1+1=", "max_tokens": 0}, "max_tokens must be an integer from 1"),
    ("/generate", {"text": "1+1=", "return_logprob": True, "logprob_start_len": 5}, "past the prompt's 5 tokens"),
    ("/generate", {"text": "1+1=", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num must be"),
    ("/generate", {"text": "1+1=", "return_logprob": True, "token_ids_logprob": [10**6]}, "outside the vocabulary"),
])
def test_what_cannot_be_served_is_a_400_in_one_sentence(url, path, body, says):
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert says in message and message.count(". ") == 0 and "\n" not in message


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def query(metrics: dict[str, float], name: str) -> dict[str, float]:
    """A Prometheus instant query of one metric name: {labels: value}."""
    return {k[len(name):]: v for k, v in metrics.items() if re.fullmatch(re.escape(name) + r"(\{.*\})?", k)}


def test_sglang_metric_names_return_values(url):
    for i in range(3):
        assert post(url, "/v1/completions", {"prompt": f"{i}2+34=", "max_tokens": 4, "temperature": 0}).status_code \
            == 200
    m = scrape(url)
    for name in ("num_running_reqs", "num_queue_reqs", "token_usage", "gen_throughput", "cache_hit_rate",
                 "num_used_tokens", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_sum"):
        series = query(m, "sglang:" + name)
        assert series, name
        assert all('model_name="default-model"' in k and "dp_rank=" in k for k in series), name
    assert sum(query(m, "sglang:prompt_tokens_total").values()) >= 3 * 7
    assert sum(query(m, "sglang:generation_tokens_total").values()) >= 3
    assert sum(query(m, "sglang:time_to_first_token_seconds_count").values()) >= 3
    for name, buckets in (("time_to_first_token_seconds", TTFT_BUCKETS), ("inter_token_latency_seconds", ITL_BUCKETS),
                          ("e2e_request_latency_seconds", E2E_BUCKETS)):
        les = {float(k.split('le="')[1].split('"')[0]) for k in query(m, f"sglang:{name}_bucket")}
        assert les == {float(b) for b in buckets} | {float("inf")}, name


def test_flush_then_metrics_and_get_load_show_the_freed_pool(url):
    for rank in range(8):  # a prompt of 5 pages per rank, left in its prefix cache
        body = {"prompt": "12345678901234567+1=", "max_tokens": 2, "temperature": 0, "routed_dp_rank": rank}
        assert post(url, "/v1/completions", body).status_code == 200
    used = query(scrape(url), "sglang:num_used_tokens")
    assert len(used) == 8 and all(v >= 16 for v in used.values())
    r = httpx.post(url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    m = scrape(url)  # right after the 200
    for name in ("sglang:num_used_tokens", "jaxdp:num_used_tokens", "sglang:token_usage"):
        assert set(query(m, name).values()) == {0.0}, name
    assert all(s["num_tokens"] == 0 and s["token_usage"] == 0 for s in httpx.get(url + "/get_load").json())


# ---- the figures after a flush, and /get_load off the event loop (no server) ----------------------------------


def test_the_engine_process_stand_in_asks_afresh_after_a_flush():
    """The HTTP process keeps the child's answer about its ranks for 50 ms; a flush answered meanwhile (the monitor
    may have asked just before) must not leave the pre-flush figures standing."""
    from types import SimpleNamespace

    from jaxdp.engine.ipc.remote import RemoteEngine

    answers = iter([{0: {"num_used_tokens": 32}}, {0: {"num_used_tokens": 0}}])
    calls = []

    def call(what, index, *args):
        calls.append(what)
        return [] if what == "flush_cache" else next(answers)

    stand_in = object.__new__(RemoteEngine)
    stand_in.failed, stand_in.index, stand_in.link = None, 0, SimpleNamespace(failed=None, call=call)
    stand_in._messages, stand_in._flushes, stand_in._states = 0, 0, {}
    stand_in._states_at, stand_in._states_seen = -1e9, (-1, -1)
    assert stand_in.rank_state(0)["num_used_tokens"] == 32
    stand_in.flush_cache()
    assert stand_in.rank_state(0)["num_used_tokens"] == 0
    assert calls == ["rank_states", "flush_cache", "rank_states"]


def test_another_nodes_flush_answer_carries_its_figures():
    from types import SimpleNamespace

    from jaxdp.engine.ipc.streams import Result
    from jaxdp.engine.nodes.link import NodeFlush, NodeLink, flush_ranks
    from jaxdp.engine.sched.pool import PagePool, PrefixCache

    pool = PagePool(8, 4)
    cache = PrefixCache(pool, True)
    cache.insert(list(range(8)), pool.alloc(2), 0)
    sched = SimpleNamespace(pool=pool, cache=cache, state=lambda: {"num_used_tokens": (8 - pool.free) * 4})
    answer = flush_ranks([sched], range(0, 1), 1, busy=False)
    assert answer.flushed and answer.states == {0: {"num_used_tokens": 0}}
    link = object.__new__(NodeLink)
    result = Result()
    link.hosts, link.remote_state, link._flushing = SimpleNamespace(nnodes=2), {0: {"num_used_tokens": 8}}, {}
    link._flushing[1] = (result, {0: NodeFlush(0, range(0, 0), True)})
    link._flush_answered(1, answer)
    assert link.remote_state == {0: {"num_used_tokens": 0}} and result.wait(1) is not None


def test_get_load_reads_the_figures_off_the_event_loop():
    import asyncio
    import time
    from types import SimpleNamespace

    from jaxdp.api.native import get_load

    def states():  # the engine process's round trip
        time.sleep(0.3)
        return [{"dp_rank": 0, "num_reqs": 0, "num_running_reqs": 0, "num_queue_reqs": 0, "num_tokens": 0,
                 "token_usage": 0.0}]

    http = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(ctx=SimpleNamespace(
        backend=SimpleNamespace(states=states)))))

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        load = await get_load(http)
        ticker.cancel()
        return load, ticks

    load, ticks = asyncio.run(main())
    assert load[0]["num_waiting_reqs"] == 0 and ticks >= 10  # the loop kept serving during the 0.3 s
