"""SGLang's own benchmark client and genai-bench against `python -m jaxdp.serve`.

The fast tests replay the HTTP requests those clients send (bodies captured with a logging proxy while
scripts/peer_benchmarks.sh ran sglang 0.5.23's `sglang.bench_serving` and genai-bench 0.0.5) and read each
answer the way that client reads it (the lines each check mirrors are named), so a change that would break
them fails here without installing either. The slow test runs the script itself: both clients, unchanged, in
venvs of their own (docs/peer-clients.md). One server for the module (default model, dp=8), always stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from servers import Server

from jaxdp.model.loader import default_model_path

ROOT = Path(__file__).resolve().parents[1]
HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
SMALL = ["--chunked-prefill-size", "64", "--max-running-requests", "32", "--cuda-graph-bs", "4",
         "--decode-log-interval", "50", "--page-size", "16", "--max-total-tokens", "1024"]

pytestmark = pytest.mark.skipif(not HAVE_DEFAULT, reason="needs the embedded default model (text prompts)")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    server = Server(["--mesh", "dp=8", *SMALL], tmp_path_factory.mktemp("peer") / "server.log")
    try:
        yield server.wait().url
    finally:
        server.stop()


def stream_lines(url: str, path: str, body: dict) -> list[bytes]:
    """The stripped, non-empty lines of a streamed answer (both clients read the body line by line)."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line.strip().encode() for line in r.iter_lines() if line.strip()]


# ---- what both clients ask before and after a run ------------------------------------------------------------


def test_discovery_endpoints(url):
    # bench_serving: model name from /v1/models (`response.json().get("data", [])[0]["id"]`), readiness by
    # polling it; without --tokenizer the tokenizer from /model_info (tokenizer_path or model_path); after the
    # run /server_info (`internal_states[0].get("avg_spec_accept_length")`), stored in its JSON output.
    models = httpx.get(url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "default-model"
    info = httpx.get(url + "/model_info", timeout=30).json()
    assert (Path(info["tokenizer_path"]) / "tokenizer.json").exists()
    assert info["served_model_name"] == "default-model" and info["is_generation"] is True
    assert info["architectures"] == ["DeepseekV3ForCausalLM"]
    server = httpx.get(url + "/server_info", timeout=30)
    assert server.status_code == 200
    states = server.json()["internal_states"]
    assert isinstance(states, list) and isinstance(states[0], dict)
    assert states[0].get("avg_spec_accept_length") is None
    json.dumps(server.json())  # bench_serving writes it into its result file
    # the older names SGLang keeps as deprecated aliases, and SGLang's readiness probe
    assert httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"] == states
    assert httpx.get(url + "/get_model_info", timeout=30).json() == info
    assert httpx.get(url + "/ready", timeout=30).status_code == 200


# ---- sglang.bench_serving ------------------------------------------------------------------------------------


def test_bench_serving_sglang_generate_stream(url):
    # --backend sglang: async_request_sglang_generate
    body = {"text": "12+34=", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
            "logprob_start_len": -1}
    lines = stream_lines(url, "/generate", body)
    assert lines[-1] == b"data: [DONE]"
    generated, output_len, texts = "", None, 0
    for chunk in lines:
        data = chunk[6:] if chunk.startswith(b"data: ") else chunk
        if data == b"[DONE]":
            continue
        data = json.loads(data)
        assert isinstance(data.get("meta_info") or {}, dict)
        if "text" in data and data["text"]:  # cumulative text; completion_tokens counts every token so far
            generated = data["text"]
            output_len = data["meta_info"]["completion_tokens"]
            texts += 1
    assert texts >= 1 and generated.startswith("46")
    assert output_len == 8  # ignore_eos: all max_new_tokens


@pytest.mark.parametrize("backend", ["sglang-oai", "vllm"])
def test_bench_serving_completions_stream(url, backend):
    # --backend sglang-oai / vllm: async_request_openai_completions reads data["choices"][0]["text"] of every
    # chunk, so no chunk may come with empty choices unless the client asked for a usage chunk
    body = {"model": "default-model", "prompt": "12+34=", "best_of": 1, "max_tokens": 8, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    lines = stream_lines(url, "/v1/completions", body)
    assert lines[-1] == b"data: [DONE]"
    text = ""
    chunks = [json.loads(c[len(b"data: "):]) for c in lines[:-1]]
    for data in chunks:
        text += data["choices"][0]["text"]
        assert (data.get("usage") or {}).get("completion_tokens", 8) == 8
    assert text.startswith("46")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bench_serving_chat_stream_and_not(url):
    # --backend sglang-oai-chat: async_request_openai_chat_completions, streamed (choices may be empty only in
    # a usage chunk; content from choices[0]["delta"]) and with --disable-stream (choices[0]["message"],
    # usage.completion_tokens)
    body = {"model": "default-model", "messages": [{"role": "user", "content": "12+34="}],
            "max_completion_tokens": 8, "stream": True, "temperature": 0.0, "ignore_eos": True}
    lines = stream_lines(url, "/v1/chat/completions", body)
    assert lines[-1] == b"data: [DONE]"
    content = ""
    for chunk in lines[:-1]:
        data = json.loads(chunk[len(b"data: "):])
        choices = data.get("choices") or []
        if choices:
            content += (choices[0].get("delta") or {}).get("content") or ""
    assert content.startswith("46")

    body["stream"] = False
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    answer = r.json()
    assert answer["choices"][0]["message"]["content"].startswith("46")
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["usage"]["prompt_tokens"] > 0


# ---- genai-bench ---------------------------------------------------------------------------------------------


def genai_parse_chat(lines: list[bytes]) -> dict:
    """genai_bench.user.openai_user.OpenAIUser.parse_chat_response, the checks that fail a request."""
    content_before_usage, finish_reason, usage, done = "", None, None, False
    for chunk in lines:
        if chunk.startswith(b"data: "):
            chunk = chunk[6:]
        elif chunk.startswith(b"data:"):
            chunk = chunk[5:]
        else:
            continue
        if chunk == b"[DONE]":
            done = True
            break
        data = json.loads(chunk)
        assert data.get("error") is None, data["error"]
        if not data["choices"] and finish_reason and "usage" in data and data["usage"]:
            usage = data["usage"]  # the usage-only chunk after the one with finish_reason ends the read
            # "received final usage chunk ... but no content was delivered" fails the request
            assert content_before_usage or usage.get("completion_tokens", 0) > 1
            break
        delta = data["choices"][0]["delta"]
        content_before_usage += delta.get("content") or ""
        finish_reason = data["choices"][0].get("finish_reason", None)
    return {"content": content_before_usage, "finish_reason": finish_reason, "usage": usage, "done": done}


@pytest.mark.parametrize("backend", ["openai", "sglang"])
def test_genai_bench_chat_stream(url, backend):
    # genai-bench --api-backend openai / sglang, task text-to-text: OpenAIUser.chat; the sglang (and vllm)
    # backend adds ignore_eos
    body = {"model": "default-model", "messages": [{"role": "user", "content": "12+34="}], "max_tokens": 8,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if backend == "sglang":
        body["ignore_eos"] = True
    got = genai_parse_chat(stream_lines(url, "/v1/chat/completions", body))
    assert got["content"].startswith("46")
    assert got["finish_reason"] == ("length" if backend == "sglang" else "stop")
    usage = got["usage"]
    assert usage is not None, "no usage-only chunk after the finish_reason chunk"
    assert usage["prompt_tokens"] > 0  # _get_usage_info: prompt_tokens, completion_tokens
    assert usage["completion_tokens"] == (8 if backend == "sglang" else len(got["content"]) + 1)  # + EOS


def test_matched_stop_names_the_eos_token(url):
    # SGLang's OpenAI answers carry matched_stop: the stop string, or the id of the stop token (EOS) that
    # ended the choice (None when the length ran out)
    body = {"model": "default-model", "prompt": "12+34=", "max_tokens": 8, "temperature": 0.0}
    choice = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(choice["matched_stop"], int)
    body["stop"] = ["6"]
    choice = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["text"] == "4" and choice["matched_stop"] == "6"
    body.update(stop=None, max_tokens=1)
    choice = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None


# ---- the real clients ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_peer_benchmarks_script(tmp_path):
    """scripts/peer_benchmarks.sh: sglang.bench_serving (6 runs) and genai-bench (2 runs), unchanged, each
    with every request completed and none failed. Creates the clients' venvs the first time (several GB)."""
    env = {**os.environ, "PEER_OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "peer_benchmarks.sh")], env=env, capture_output=True,
                          text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "peer benchmarks passed" in proc.stdout
    assert proc.stdout.count("failed 0") == 6
    assert proc.stdout.count("errors 0") == 2
