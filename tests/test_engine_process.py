"""`--engine-process` (the default on one node): the engine runs in a child process behind the same server
(`engine.ipc.process` there, `engine.ipc.remote` here). The tokens are the in-process engine's; refusals, aborts
and the admin endpoints answer as before; a dead engine process ends every request in flight with a 503 and fails
/health, never a hang; a start-up error is the child's one sentence and exit status; SIGTERM ends both processes.
(`python -m pytest -m slow tests/test_reliability.py tests/test_fuzz_server.py` runs those modules again with
`--no-engine-process`, the engine in the server's process.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from servers import Server

from jaxdp.bench.cpu import child_pids

ARGS = ["--engine-process", "--model-path", "tiny", "--dp-size", "2", "--tp-size", "2", "--chunked-prefill-size", "32",
        "--max-running-requests", "8", "--cuda-graph-bs", "4", "--page-size", "16", "--max-total-tokens", "8192",
        "--context-length", "4096"]
ONE_ENGINE = ["--model-path", "tiny", "--mesh", "dp=2", "--cuda-graph-bs", "4",
              "--chunked-prefill-size", "32", "--max-total-tokens", "2048"]
PROMPTS = [[1 + i, 7, 3 + 2 * i, 11] * (1 + i) for i in range(6)]


def generate(url: str, ids: list[int], n: int, **extra) -> httpx.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, **extra}
    return httpx.post(url + "/generate", json=body, timeout=60)


def sse(url: str, ids: list[int], n: int, into: list | None = None, **extra) -> list:
    """A streamed /generate's events, appended to `into` as they arrive."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "stream": True, **extra}
    events = [] if into is None else into
    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(ARGS, tmp_path_factory.mktemp("engine-process") / "server.log")
    try:
        yield s.wait()
    finally:
        s.stop()


def test_the_engine_process_gives_the_in_process_engines_tokens(server):
    """Six requests at once over two replicas of tp=2 in the child; each gets what an in-process engine gives."""
    from jaxdp.engine import Engine, EngineConfig, SamplingParams

    out: dict[int, list[int]] = {}

    def one(i: int) -> None:  # half streamed, all at once: they share steps in the child
        if i % 2:
            events = sse(server.url, PROMPTS[i], 12)
            assert events[-1] == "[DONE]"
            out[i] = events[-2]["output_ids"]
        else:
            out[i] = generate(server.url, PROMPTS[i], 12).json()["output_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine = Engine("tiny", "tp=2", EngineConfig(num_pages=64, page_size=16, max_running_requests=8,
                                                   chunked_prefill_size=32, decode_buckets=[4]))
    try:
        want = [r.output_ids for r in engine.generate(PROMPTS, SamplingParams(12, temperature=0, ignore_eos=True))]
    finally:
        engine.shutdown()
    assert [out[i] for i in range(len(PROMPTS))] == want


def test_refusals_aborts_and_the_admin_endpoints_answer_as_in_one_process(server):
    r = generate(server.url, [1] * 4200, 4)  # past the context
    assert r.status_code == 400 and "shorten the prompt" in r.json()["error"]["message"]
    r = generate(server.url, [10**6], 4)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    events: list = []
    t = threading.Thread(target=sse, args=(server.url, [5, 6, 7], 2000, events), kwargs={"rid": "long-one"})
    t.start()
    t0 = time.time()
    while not events and time.time() - t0 < 30:
        time.sleep(0.02)
    assert httpx.post(server.url + "/abort_request", json={"rid": "long-one"}, timeout=30).status_code == 200
    t.join(30)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-2]["meta_info"]["completion_tokens"] < 200
    load = httpx.get(server.url + "/get_load", timeout=30).json()  # two replicas of one rank each, in one child
    assert [s["dp_rank"] for s in load] == [0, 1] and all(s["num_reqs"] == 0 for s in load)
    flush = httpx.post(server.url + "/flush_cache", timeout=30)
    assert flush.status_code == 200 and flush.text.count(": flushed") == 2  # each replica says what it did
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    compiles = [line for line in metrics.splitlines() if line.startswith("jaxdp:compiles_total")]
    assert compiles and float(compiles[0].split()[-1]) > 0  # the child's compiles, counted there
    pid = server.proc.pid  # the server's process never started a JAX backend (on a GPU it would take memory)
    names = {open(f"/proc/{pid}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{pid}/task")}
    assert not any(n.startswith("tf_") for n in names), names  # (XLA:CPU's pool threads: tf_XLAEigen)
    (child,) = child_pids(pid)
    assert any(open(f"/proc/{child}/task/{t}/comm").read().startswith("tf_") for t in os.listdir(f"/proc/{child}/task"))
    for replica in (0, 1):  # both replicas ran steps, and the server counts them
        assert f'jaxdp:steps_total{{gather_mode="max_len",kind="decode",replica="{replica}"}}' in metrics


def test_a_dead_engine_process_ends_every_request_with_a_503_and_fails_health(server):
    (child,) = child_pids(server.proc.pid)
    events: list = []
    t = threading.Thread(target=sse, args=(server.url, [9, 9, 9], 2000, events))
    t.start()
    t0 = time.time()
    while not events and time.time() - t0 < 30:
        time.sleep(0.02)
    os.kill(child, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive() and events[-1] == "[DONE]"
    assert "engine process exited unexpectedly" in events[-2]["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    r = generate(server.url, [1, 2], 2)
    assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0


def test_a_start_up_error_in_the_engine_process_is_its_one_sentence(tmp_path):
    from jaxdp.model.loader import default_model_path

    (tmp_path / "config.json").write_text((default_model_path() / "config.json").read_text())  # no weights
    r = subprocess.run([sys.executable, "-m", "jaxdp.serve", "--engine-process", "--model-path", str(tmp_path),
                        "--mesh", "dp=2"], capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if not line.startswith("[")]  # (log lines have a time)
    assert r.returncode == 2 and len(errors) == 1 and "holds no .safetensors files" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_sigterm_ends_the_server_and_its_engine_process(tmp_path):
    s = Server(ONE_ENGINE, tmp_path / "server.log").wait()
    try:
        (child,) = child_pids(s.proc.pid)
        assert generate(s.url, [1, 2, 3], 3).status_code == 200
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        t0 = time.time()
        while os.path.exists(f"/proc/{child}") and time.time() - t0 < 10:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{child}") or "(Z)" in open(f"/proc/{child}/stat").read()  # gone
    finally:
        s.stop()


def test_engine_process_across_nodes_is_refused_in_one_sentence():
    """Node 0 of several runs its engine in its own process (it takes part in the model world's collectives):
    asked for explicitly, the flag is refused before anything waits for the other nodes."""
    r = subprocess.run([sys.executable, "-m", "jaxdp.serve", "--engine-process", "--model-path", "tiny",
                        "--mesh", "dp=2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if not line.startswith("[")]
    assert r.returncode == 2 and errors == [
        "error: --engine-process runs one node's engine in a child process; drop it with --nnodes > 1, where node 0 "
        "runs its engine in the server's process"], r.stderr
