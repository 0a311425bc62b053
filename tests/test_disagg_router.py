"""Prefill and decode on separate servers behind SGLang's router (issue 30): `python -m jaxdp.serve
--disaggregation-mode prefill` and `... decode`, each dp=2, and `sglang_router.launch_router --pd-disaggregation`
(sglang-router 0.3.2, installed by the fixture in a venv of its own under ~/.cache/jaxdp): concurrent greedy
requests through /generate and /v1/completions (streamed and not) answer what one colocated engine answers, and
every page is back on both servers afterwards. Bootstrap fields sent to a server not in that mode are refused
in one sentence."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import Server

from jaxdp.bench.launch import free_port
from jaxdp.model.loader import default_model_path

ROUTER_VERSION = "0.3.2"
SMALL = ["--chunked-prefill-size", "64", "--max-running-requests", "16", "--cuda-graph-bs", "4", "8",
         "--page-size", "16", "--max-total-tokens", "2048", "--mesh", "dp=2"]
PROMPTS = ["37+48=", "91-17=", "sort 3142=", "reverse abcde=", "6*7=", "123*4=", "12+34=" * 8, "count a abcab="]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (default_model_path() / "tokenizer.json").exists(),
                                                   reason="needs the default model")]


def router_python() -> Path:
    venv = Path.home() / ".cache" / "jaxdp" / f"sglang-router-{ROUTER_VERSION}"
    py = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"sglang-router=={ROUTER_VERSION}"], check=True)
        (venv / ".installed").touch()
    return py


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    bootstrap = free_port()
    prefill = Server([*SMALL, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)],
                     logs / "prefill.log")
    decode = Server([*SMALL, "--disaggregation-mode", "decode"], logs / "decode.log")
    router, port = None, free_port()
    try:
        prefill.wait(), decode.wait()
        router = subprocess.Popen([str(router_python()), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                   "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
                                   "--host", "127.0.0.1", "--port", str(port),
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                                  stdout=(logs / "router.log").open("w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, (logs / "router.log").read_text()[-2000:]
            time.sleep(0.5)
        yield url, prefill, decode
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=20)
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def expected():
    """What one colocated engine answers, greedy."""
    from jaxdp.engine import Engine, SamplingParams

    engine = Engine("default", "dp=1")
    try:
        reqs = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS], SamplingParams(max_new_tokens=8,
                                                                                             temperature=0))
        return [engine.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in reqs]
    finally:
        engine.shutdown()


def _generate(url: str, prompt: str) -> str:
    r = httpx.post(url + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8,
                                                                                "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def _completion(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "default", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _pages_back(server: Server) -> None:
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    for rank in info["internal_states"]:
        assert rank["free_pages"] + rank["cached_pages"] == rank["num_pages"], rank
        assert rank["num_reqs"] == 0, rank


def test_through_the_router_the_decode_server_answers_as_one_server(deployment, expected):
    url, prefill, decode = deployment
    calls = [(_generate, (url, p)) for p in PROMPTS] + [(_completion, (url, p, False)) for p in PROMPTS] + \
        [(_completion, (url, p, True)) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda c: c[0](*c[1]), calls))
    n = len(PROMPTS)
    assert got[:n] == expected and got[n: 2 * n] == expected and got[2 * n:] == expected
    for server in (prefill, decode):
        _pages_back(server)


def test_bootstrap_fields_sent_to_a_server_not_in_that_mode_are_refused(deployment):
    _, prefill, decode = deployment
    for server in (prefill, decode):  # (a server that cannot generate alone answers its liveness there)
        assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    r = httpx.post(prefill.url + "/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "send requests through SGLang's router" in r.text
    r = httpx.post(decode.url + "/generate", json={"text": "1+1=", "bootstrap_host": "127.0.0.1",
                                                   "bootstrap_port": 1, "bootstrap_room": -3})
    assert r.status_code == 400 and "bootstrap_room" in r.text
