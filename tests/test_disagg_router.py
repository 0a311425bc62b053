"""Prefill and decode on separate servers behind SGLang's router (issue 30, its "Shown by"), with real servers:
a prefill server (`--mesh dp=4`), a decode server `--mesh dp=4` and another `--mesh tp=4`, each behind its own
`sglang_router.launch_router --pd-disaggregation` (sglang-router 0.3.2, installed by the fixture in a venv of its
own under ~/.cache/jaxdp), one deployment for the whole module:

- 64 concurrent greedy requests of mixed lengths with shared prefixes, through /generate and /v1/completions
  (streamed and not), answer what one colocated engine answers, with prefix-cache hits on the prefill side;
  every page back on every server afterwards; the hand-off's metrics count every transfer;
- the router's retries (a decode server that answers 503 once per request, after doing the work): each client
  gets its tokens once, and the abandoned attempt's KV is dropped on the prefill side;
- a decode server that disappears (a room nobody takes): the prefill side's pages are back at once, its offer
  counted in flight, then dropped;
- a decode server of another model (bf16 weights and cache), a transfer backend not installed, bootstrap fields
  where they do not belong: one sentence each, nothing left allocated;
- last, killing the prefill server while the decode server's requests wait for their KV: each ends with one
  sentence, the decode server's pools full again.
"""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from servers import Server, completion_text

from jaxdp.model.loader import default_model_path
from jaxdp.net import free_port

ROUTER_VERSION = "0.3.2"
COMMON = ["--chunked-prefill-size", "256", "--page-size", "16", "--max-total-tokens", "16384",
          "--cuda-graph-bs", "4", "8", "16"]
PREFILL = [*COMMON, "--mesh", "dp=4", "--max-running-requests", "32", "--disaggregation-mode", "prefill",
           "--disaggregation-timeout", "20"]
DECODE = [*COMMON, "--max-running-requests", "64", "--disaggregation-mode", "decode", "--disaggregation-timeout",
          "60"]
MAX_NEW = 8

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


def prompts() -> list[str]:
    """64 prompts of 5 to about 200 tokens; most share one of four long prefixes (prefix-cache hits)."""
    heads = ["12+34=" * 20, "sort 3142=" * 14, "reverse abcde=" * 10, "count a abcab=" * 9]
    tails = ["37+48=", "91-17=", "6*7=", "123*4=", "sort 4213=", "reverse xyz=", "count b abba=", "5+5="]
    out = []
    for i in range(64):
        if i % 8 == 7:  # some short prompts of their own
            out.append(tails[i // 8] + tails[(i // 8 + 3) % 8])
        else:
            out.append(heads[i % 4] * (1 + (i // 16) % 2) + tails[i % 8])
    return out


class Router:
    def __init__(self, prefill: Server, bootstrap: int, decode_url: str, log: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen([str(router_python()), "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                      "--prefill", prefill.url, str(bootstrap), "--decode", decode_url,
                                      "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host",
                                      "127.0.0.1", "--prometheus-port", str(free_port()), *extra],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log.read_text()[-2000:]
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)


class FlakyDecode:
    """A proxy in front of a decode server that forwards every request, and answers the first attempt of each
    prompt with a 503 after the decode server did the work (what a router sees of a server that failed late):
    SGLang's router retries it with a new bootstrap room."""

    def __init__(self, upstream: str):
        self.upstream, self.attempts, self.lock = upstream, {}, threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes, ctype: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                r = httpx.get(proxy.upstream + self.path, timeout=30)
                self._answer(r.status_code, r.content, r.headers.get("content-type", "application/json"))

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                key = json.dumps({k: v for k, v in json.loads(body).items() if not k.startswith("bootstrap")},
                                 sort_keys=True)
                with proxy.lock:
                    n = proxy.attempts[key] = proxy.attempts.get(key, 0) + 1
                r = httpx.post(proxy.upstream + self.path, content=body, timeout=120,
                               headers={"Content-Type": "application/json"})
                if n == 1:
                    self._answer(503, b'{"error": {"message": "a stand-in failure after the work"}}',
                                 "application/json")
                else:
                    self._answer(r.status_code, r.content, r.headers.get("content-type", "application/json"))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    bootstrap = free_port()
    servers = {"prefill": Server([*PREFILL, "--disaggregation-bootstrap-port", str(bootstrap)], logs / "prefill.log"),
               "dp4": Server([*DECODE, "--mesh", "dp=4"], logs / "decode-dp4.log"),
               "tp4": Server([*DECODE, "--mesh", "tp=4"], logs / "decode-tp4.log"),
               "bf16": Server([*DECODE, "--mesh", "dp=1", "--dtype", "bfloat16", "--max-running-requests", "4"],
                              logs / "decode-bf16.log")}
    routers, flaky = {}, None
    try:
        for s in servers.values():
            s.wait()
        flaky = FlakyDecode(servers["dp4"].url)
        routers = {"dp4": Router(servers["prefill"], bootstrap, servers["dp4"].url, logs / "router-dp4.log"),
                   "tp4": Router(servers["prefill"], bootstrap, servers["tp4"].url, logs / "router-tp4.log"),
                   "flaky": Router(servers["prefill"], bootstrap, flaky.url, logs / "router-flaky.log",
                                   "--disable-circuit-breaker", "--retry-initial-backoff-ms", "10")}
        for r in routers.values():
            r.wait()
        yield servers, routers, bootstrap, flaky
    finally:
        for r in routers.values():
            r.stop()
        if flaky is not None:
            flaky.close()
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def expected():
    """What one colocated engine answers, greedy, for every prompt."""
    from jaxdp.engine import Engine, SamplingParams

    engine = Engine("default", "dp=1")
    try:
        ps = prompts()
        reqs = engine.generate([engine.tokenizer.encode(p) for p in ps], SamplingParams(max_new_tokens=MAX_NEW,
                                                                                        temperature=0))
        return {p: engine.tokenizer.decode(r.output_ids, skip_special_tokens=True) for p, r in zip(ps, reqs,
                                                                                                    strict=True)}
    finally:
        engine.shutdown()


def _generate(url: str, prompt: str) -> str:
    r = httpx.post(url + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW,
                                                                                "temperature": 0}}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def _completion(url: str, prompt: str, stream: bool) -> str:
    return completion_text(url, prompt, MAX_NEW, stream, timeout=180)


def _call(url: str, i: int, prompt: str) -> str:
    """Request i of a wave: /generate, /v1/completions, or /v1/completions streamed, in turn."""
    if i % 3 == 0:
        return _generate(url, prompt)
    return _completion(url, prompt, stream=i % 3 == 2)


def _wave(url: str, ps: list[str]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(ps)) as pool:
        return list(pool.map(lambda a: _call(url, *a), enumerate(ps)))


def _states(server: Server) -> list[dict]:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"]


def _pages_back(server: Server, timeout: float = 30) -> None:
    """Every page of every rank free or in the prefix cache, no request left (waits for the loop to settle)."""
    deadline = time.monotonic() + timeout
    while True:
        states = _states(server)
        ok = all(s["free_pages"] + s["cached_pages"] == s["num_pages"] and s["num_reqs"] == 0 for s in states)
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for s in states:
        assert s["free_pages"] + s["cached_pages"] == s["num_pages"] and s["num_reqs"] == 0, s
        if "disagg" in s:
            d = s["disagg"]
            assert d.get("prealloc", 0) == d.get("transfer", 0) == 0, d


def _metric(server: Server, name: str) -> float:
    """The sum over ranks of a Prometheus sample of the server's /metrics (by its exact name)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _failed(server: Server) -> float:
    return _metric(server, "sglang:num_bootstrap_failed_reqs_total") + \
        _metric(server, "sglang:num_transfer_failed_reqs_total")


@pytest.mark.parametrize("decode", ["dp4", "tp4"])
def test_64_concurrent_requests_answer_as_one_server(deployment, expected, decode):
    """Prefill dp=4 and decode dp=4 (then tp=4: the hand-off maps a dp rank's pages onto a tp group's pool)."""
    servers, routers, _, _ = deployment
    prefill, dec, url = servers["prefill"], servers[decode], routers[decode].url
    ps = prompts()
    cached0 = _metric(prefill, "sglang:cached_tokens_total")
    pulled0 = _metric(dec, "sglang:kv_transfer_latency_ms_count")
    t0 = time.monotonic()
    got = _wave(url, ps)
    assert [g for g in got] == [expected[p] for p in ps]
    assert _metric(prefill, "sglang:cached_tokens_total") > cached0 + 500  # prefix-cache hits on the prefill side
    assert _metric(dec, "sglang:kv_transfer_latency_ms_count") == pulled0 + len(ps)  # every KV pulled once
    assert _metric(dec, "sglang:num_transfer_failed_reqs_total") == 0
    assert _metric(dec, "sglang:num_bootstrap_failed_reqs_total") == 0
    assert _metric(dec, "sglang:kv_transfer_speed_gb_s_count") == pulled0 + len(ps)
    for server in (prefill, dec):
        _pages_back(server)
    assert _metric(prefill, "sglang:num_prefill_inflight_queue_reqs") == 0  # every offer taken
    assert time.monotonic() - t0 < 120


def test_the_routers_retries_never_duplicate_tokens(deployment, expected):
    """SGLang's router retries a request that failed with a 5xx (408, 429, 500, 502-504) with a new bootstrap
    room, on both servers (sglang-router 0.3.2); a streamed answer is never retried once its status went out.
    Here the decode server does each request's work and then answers 503 once: the router sends it again, the
    client gets its tokens once; the prefill side read each prompt twice, the abandoned room's KV was taken by
    the decode server that did the work, so nothing stays offered."""
    servers, routers, _, flaky = deployment
    ps = prompts()[:12]
    pulled0 = _metric(servers["dp4"], "sglang:kv_transfer_latency_ms_count")
    got = _wave(routers["flaky"].url, ps)
    assert got == [expected[p] for p in ps]
    assert sorted(flaky.attempts.values()) == [2] * len(ps)  # every request was retried once
    assert _metric(servers["dp4"], "sglang:kv_transfer_latency_ms_count") == pulled0 + 2 * len(ps)
    for server in (servers["prefill"], servers["dp4"]):
        _pages_back(server)
    assert _metric(servers["prefill"], "sglang:num_prefill_inflight_queue_reqs") == 0


def test_a_decode_server_that_disappears_frees_the_prefill_side(deployment):
    """The router sends a request to both servers; the decode server is gone before it takes the KV. The
    prefill rank's pages are back at once (the KV is read out of them as the prompt finishes), its offer counts
    in flight, and is dropped after --disaggregation-timeout (20 s here)."""
    servers, _, bootstrap, _ = deployment
    prefill = servers["prefill"]
    dropped0 = _metric(prefill, "jaxdp:kv_offers_dropped_total")
    r = httpx.post(prefill.url + "/generate", json={"text": "12+34=" * 5, "sampling_params": {"max_new_tokens": 8},
                                                     "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                                                     "bootstrap_room": 12345}, timeout=60)
    assert r.status_code == 200, r.text
    _pages_back(prefill)
    assert _metric(prefill, "sglang:num_prefill_inflight_queue_reqs") == 1
    deadline = time.monotonic() + 40
    while _metric(prefill, "sglang:num_prefill_inflight_queue_reqs") > 0:
        assert time.monotonic() < deadline, "the offer was never dropped"
        time.sleep(1)
    assert _metric(prefill, "jaxdp:kv_offers_dropped_total") == dropped0 + 1


def test_a_decode_server_of_another_model_refuses_in_one_sentence(deployment):
    servers, _, bootstrap, _ = deployment
    bf16 = servers["bf16"]
    r = httpx.post(bf16.url + "/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 4},
                                                  "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                                                  "bootstrap_room": 77}, timeout=60)
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert ("serves another model than this decode server" in message or "KV cache" in message), message
    assert "\n" not in message
    _pages_back(bf16)
    assert _metric(bf16, "sglang:num_bootstrap_failed_reqs_total") == 1


def test_a_transfer_backend_not_installed_is_one_sentence(tmp_path):
    r = subprocess.run([sys.executable, "-m", "jaxdp.serve", "--mesh", "dp=1", "--disaggregation-mode", "decode",
                        "--disaggregation-transfer-backend", "mooncake", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "--disaggregation-transfer-backend" in line]
    assert lines and "mooncake" in lines[-1] and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_bootstrap_fields_where_they_do_not_belong_are_refused(deployment):
    servers, _, _, _ = deployment
    for server in (servers["prefill"], servers["dp4"]):  # (a server that cannot generate alone answers liveness)
        assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    r = httpx.post(servers["prefill"].url + "/generate", json={"text": "1+1=",
                                                               "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "send requests through SGLang's router" in r.text
    r = httpx.post(servers["dp4"].url + "/generate", json={"text": "1+1=", "bootstrap_host": "127.0.0.1",
                                                           "bootstrap_port": 1, "bootstrap_room": -3})
    assert r.status_code == 400 and "bootstrap_room" in r.text
    r = httpx.post(servers["dp4"].url + "/generate", json={"text": "1+1=", "bootstrap_host": "127.0.0.1",
                                                           "bootstrap_room": 3})
    assert r.status_code == 400 and "bootstrap_port is missing" in r.text


def test_killing_the_prefill_server_mid_transfer(deployment):
    """(Last: the prefill server does not come back.) Long prompts through the router; once the decode server
    has requests waiting for their KV, the prefill server is killed: every one of them ends with one sentence,
    the router's answers are errors (never tokens of another attempt), the decode server's pools are full again."""
    servers, routers, bootstrap, _ = deployment
    prefill, dec = servers["prefill"], servers["dp4"]
    failed0 = _failed(dec)
    ps = ["12+34=" * 40 + str(i) for i in range(48)]

    def one(i: int) -> tuple[int, str]:
        r = httpx.post(routers["dp4"].url + "/generate", json={"text": ps[i], "sampling_params": {
            "max_new_tokens": 64, "temperature": 0}}, timeout=180)
        return r.status_code, r.text

    with concurrent.futures.ThreadPoolExecutor(len(ps)) as pool:
        futures = [pool.submit(one, i) for i in range(len(ps))]
        deadline = time.monotonic() + 60
        while sum(s["disagg"]["transfer"] for s in _states(dec)) == 0:
            assert time.monotonic() < deadline, "no request ever waited for its KV"
            time.sleep(0.02)
        os.killpg(prefill.proc.pid, signal.SIGKILL)
        prefill.proc.wait()
        answers = [f.result() for f in futures]
    assert any(status != 200 for status, _ in answers), "every request finished before the kill"
    _pages_back(dec)
    assert _failed(dec) > failed0
    # what the decode server says (the router passes it on, or its own error): one sentence
    r = httpx.post(dec.url + "/generate", json={"text": "1+1=", "sampling_params": {"max_new_tokens": 4},
                                                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                                                "bootstrap_room": 5}, timeout=60)
    message = r.json()["error"]["message"]
    gone = ("no prefill server answers at bootstrap", "stopped answering")  # (before or after it knew the model)
    assert r.status_code == 503 and f"bootstrap 127.0.0.1:{bootstrap}" in message and "\n" not in message
    assert any(words in message for words in gone), message
    _pages_back(dec)
