"""Several nodes: two processes with 4 CPU devices each on loopback form one `--mesh dp=8` model world.

Completions through node 0 equal the single-process dp=8 server's greedy outputs, for requests pinned to
ranks 0-3 (node 0) and 4-7 (node 1), over IPv4 and over IPv6 (`--dist-init-addr [::1]:PORT`), and under
dp=4,tp=2 (two whole TP groups per node). Killing node 1 mid-load, or stalling it (SIGSTOP), makes node 0
fail its requests and refuse new ones (503) within `--dist-timeout`; stopping node 0 ends node 1.
SGLang's modifier flags compose with --mesh on one node and on two, and /flush_cache on node 0 flushes
every node's ranks, refusing while a request runs, with one line per node. Start-up mistakes end in one
line. The exchange itself, without processes, is tests/test_exchange.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from servers import Server, free_port

from jaxdp.engine.nodes.hosts import DistError, parse_dist_addr
from jaxdp.model.loader import default_model_path

pytestmark = pytest.mark.skipif(not (default_model_path() / "config.json").exists(),
                                reason="needs the embedded default model")

TIMEOUT = 10  # --dist-timeout of the clusters below
ARGS = ["--chunked-prefill-size", "64", "--max-running-requests", "32", "--cuda-graph-bs", "4", "--page-size", "16",
        "--max-total-tokens", "512", "--decode-log-interval", "20"]
PROMPTS = ["37+48=", "91-17=", "23*4=", "count a abcab=", "sort 3142=", "reverse cat=", "12+30=", "45-9="]
NODE_ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def generate(server, prompt: str, rank: int | None = None, max_new_tokens: int = 12) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if rank is not None:
        body["routed_dp_rank"] = rank
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


class Cluster:
    """Node 0 (HTTP) and node 1 (its ranks' loop and /health) of one dp=8 model world."""

    def __init__(self, tmp, host: str, mesh: str = "dp=8", extra: tuple[str, ...] = ()):
        addr = f"[{host}]:{free_port()}" if ":" in host else f"{host}:{free_port()}"
        common = ["--mesh", mesh, *extra, "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", str(TIMEOUT),
                  *ARGS]
        self.node0 = Server([*common, "--node-rank", "0"], tmp / "node0.log", env=NODE_ENV)
        self.node1 = Server([*common, "--node-rank", "1"], tmp / "node1.log", env=NODE_ENV)

    def __enter__(self):
        self.node0.wait(), self.node1.wait()
        return self

    def __exit__(self, *exc):
        self.node0.stop()
        self.node1.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process dp=8 server's greedy outputs, each prompt pinned to each rank in turn."""
    server = Server(["--mesh", "dp=8", *ARGS], tmp_path_factory.mktemp("single") / "server.log")
    try:
        server.wait()
        return {p: generate(server, p, rank=i)["output_ids"] for i, p in enumerate(PROMPTS)}
    finally:
        server.stop()


def check_same_as_single_process(cluster: Cluster, reference: dict) -> None:
    node0 = cluster.node0
    for i, p in enumerate(PROMPTS):  # prompt i on rank i: four on node 0's ranks, four on node 1's
        out = generate(node0, p, rank=i)
        assert out["meta_info"]["dp_rank"] == i
        assert out["output_ids"] == reference[p], (p, i)
    for i, p in enumerate(PROMPTS):  # and the other way round, all at once
        rank = 7 - i
        assert generate(node0, p, rank=rank)["output_ids"] == reference[p], (p, rank)
    client = openai.OpenAI(base_url=node0.url + "/v1", api_key="none")
    text = client.completions.create(model="default-model", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert text.choices[0].text == generate(node0, PROMPTS[0])["text"]
    stream = client.completions.create(model="default-model", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == generate(node0, PROMPTS[1])["text"]
    # log probabilities and top alternatives come back from node 1's ranks as from node 0's
    logprobs = [client.completions.create(model="default-model", prompt=PROMPTS[2], max_tokens=6, temperature=0,
                                          logprobs=3, extra_body={"routed_dp_rank": r}).choices[0].logprobs
                for r in (1, 6)]
    assert len(logprobs[1].token_logprobs) == len(logprobs[1].top_logprobs) == len(logprobs[1].tokens) >= 1
    assert all(len(t) == 3 for t in logprobs[1].top_logprobs)
    assert logprobs[1].tokens == logprobs[0].tokens
    np.testing.assert_allclose(logprobs[1].token_logprobs, logprobs[0].token_logprobs, atol=1e-4)
    load = httpx.get(node0.url + "/get_load", timeout=10).json()
    assert [s["dp_rank"] for s in load] == list(range(8))
    assert httpx.get(cluster.node1.url + "/health", timeout=5).status_code == 200
    # node 1 exposes nothing else
    assert httpx.post(cluster.node1.url + "/generate", json={"text": "1+1="}, timeout=5).status_code == 404


def test_two_nodes_match_single_process_and_survive_a_dead_node(tmp_path, reference):
    with Cluster(tmp_path, "127.0.0.1") as cluster:
        check_same_as_single_process(cluster, reference)
        metrics = httpx.get(cluster.node0.url + "/metrics", timeout=10).text
        assert "jaxdp:step_agreement_seconds_count" in metrics

        async def load():
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"text": "1+1=", "sampling_params": {"max_new_tokens": 400, "temperature": 0,
                                                            "ignore_eos": True}}
                tasks = [asyncio.create_task(c.post(cluster.node0.url + "/generate",
                                                    json={**body, "routed_dp_rank": r})) for r in range(8)]
                await asyncio.sleep(1.5)  # they are decoding on both nodes
                t0 = time.monotonic()
                cluster.node1.proc.kill()
                while (await c.get(cluster.node0.url + "/health")).status_code == 200:
                    await asyncio.sleep(0.1)
                unhealthy_after = time.monotonic() - t0
                answers = await asyncio.wait_for(asyncio.gather(*tasks), timeout=3 * TIMEOUT)
                return unhealthy_after, time.monotonic() - t0, answers

        unhealthy_after, ended_after, answers = asyncio.run(load())
        assert unhealthy_after < TIMEOUT + 5, unhealthy_after
        assert ended_after < TIMEOUT + 5, ended_after
        for a in answers:  # every in-flight request gets an error that names the node
            assert a.status_code == 503, a.text
            assert "node 1" in a.json()["error"]["message"]
        r = httpx.post(cluster.node0.url + "/generate", json={"text": "1+1="}, timeout=10)
        assert r.status_code == 503 and "node 1" in r.json()["error"]["message"]
        assert cluster.node0.proc.poll() is None  # node 0 keeps answering (503), it does not hang or crash
        # the exchange's timeout, the watchdog's or the failed collective, whichever comes first, names the node
        assert re.search(r"no answer from node 1|node 1 died", cluster.node0.log.read_text())


def test_tp_groups_stay_on_a_node_and_a_stalled_node_fails_node_0_within_the_timeout(tmp_path, reference):
    """dp=4,tp=2 over two nodes (each node two whole TP groups) gives the same answers; then SIGSTOP on
    node 1 (no socket closes, no process exits): node 0's watchdog ends the wait."""
    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    if not children.exists():
        pytest.skip("needs /proc/PID/task/PID/children (Linux)")
    with Cluster(tmp_path, "127.0.0.1", mesh="dp=4,tp=2") as cluster:
        info = httpx.get(cluster.node0.url + "/get_server_info", timeout=10).json()
        assert "dp=4 x tp=2" in json.dumps(info)
        for i, p in enumerate(PROMPTS[:4]):  # ranks 0-1 on node 0, 2-3 on node 1
            assert generate(cluster.node0, p, rank=i)["output_ids"] == reference[p], (p, i)
        parent = cluster.node1.proc.pid  # node 1 runs as the child of a small supervisor
        node1 = int(Path(f"/proc/{parent}/task/{parent}/children").read_text().split()[0])
        body = {"text": "2+2=", "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
                "routed_dp_rank": 3}

        async def stall():
            async with httpx.AsyncClient(timeout=120) as c:
                task = asyncio.create_task(c.post(cluster.node0.url + "/generate", json=body))
                await asyncio.sleep(1.5)
                t0 = time.monotonic()
                os.kill(node1, signal.SIGSTOP)
                while (await c.get(cluster.node0.url + "/health")).status_code == 200:
                    await asyncio.sleep(0.1)
                return time.monotonic() - t0, await asyncio.wait_for(task, timeout=3 * TIMEOUT)

        try:
            unhealthy_after, answer = asyncio.run(stall())
        finally:
            os.kill(node1, signal.SIGCONT)
        assert unhealthy_after < TIMEOUT + 5, unhealthy_after
        assert answer.status_code == 503 and "no answer from node 1" in answer.json()["error"]["message"]
        # node 1, running again, ends by itself with one line: its exchange finds node 0 gone, or JAX's runtime,
        # which gave it up while it stalled, aborts it and its supervisor says so
        assert cluster.node1.proc.wait(timeout=3 * TIMEOUT) == 1
        assert "error: node 1:" in cluster.node1.log.read_text()


COMPOSED = ("--enable-dp-lm-head", "--moe-dense-tp-size", "1")  # SGLang's modifier flags on top of --mesh dp=8
COMPOSED_SPEC = "dp=8,tp=1,moe=tp,dense=replicated,lm_head=dp"


def used_tokens(server) -> list[float]:
    """jaxdp:num_used_tokens per rank (another node's ranks as of their last report to node 0)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = dict(re.findall(r'^jaxdp:num_used_tokens\{dp_rank="(\d+)"[^}]*\} (\S+)$', text, re.M))
    return [float(found[str(r)]) for r in range(8)]


def wait_for(condition, what: str, timeout: float = 5):
    t0 = time.monotonic()
    while not (value := condition()):
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.1)
    return value


def check_flush(node0, nodes: list[tuple[range, str]]) -> None:
    """After a load on every rank: a flush while a request runs is refused everywhere; once idle it frees
    every rank's cached tokens, on every node, and says per node what it did."""
    for i, p in enumerate(PROMPTS):  # prompts of whole pages (16 tokens): their pages stay in the prefix cache
        generate(node0, " ".join([p] * 5), rank=i, max_new_tokens=4)
    wait_for(lambda: all(x > 0 for x in used_tokens(node0)), "cached tokens on every rank")

    async def flush_while_busy():  # the flush is sent once the request has streamed a token: it surely runs
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"text": "9+9=", "stream": True, "routed_dp_rank": 7,
                    "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
            async with c.stream("POST", node0.url + "/generate", json=body) as answer:
                lines = answer.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
                refused = await c.post(node0.url + "/flush_cache")
                async for _ in lines:  # read the stream to its end
                    pass
            return refused, answer

    refused, answer = asyncio.run(flush_while_busy())
    assert answer.status_code == 200
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "requests are running or waiting" in message and all(f"{n}: not flushed" in message for _, n in nodes)
    time.sleep(0.5)  # node 1's ranks' states reach node 0 four times a second
    before = used_tokens(node0)
    assert all(u > 0 for u in before)  # nothing was flushed anywhere
    r = httpx.post(node0.url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    lines = r.text.splitlines()
    assert lines[0] == "Cache flushed."
    for (ranks, name), line in zip(nodes, lines[1:], strict=True):  # each node freed what its ranks held
        assert line == f"{name}: flushed, {sum(before[r] for r in ranks):.0f} cached tokens freed", line
    wait_for(lambda: used_tokens(node0) == [0.0] * 8, f"no tokens left on any rank: {used_tokens(node0)}")


def test_composed_flags_and_flush_on_one_node(tmp_path, reference):
    server = Server(["--mesh", "dp=8", *COMPOSED, *ARGS], tmp_path / "server.log")
    try:
        server.wait()
        assert httpx.get(server.url + "/get_server_info", timeout=10).json()["mesh"] == COMPOSED_SPEC
        for i, p in enumerate(PROMPTS):
            assert generate(server, p, rank=i)["output_ids"] == reference[p], (p, i)
        check_flush(server, [(range(8), "node 0 (ranks 0-7)")])
    finally:
        server.stop()


def test_composed_flags_and_flush_reach_every_node(tmp_path, reference):
    """Two nodes under --mesh dp=8 plus SGLang's modifier flags: the same answers as one process, and
    /flush_cache on node 0 flushes node 1's ranks too (before, 256 tokens stayed cached there)."""
    with Cluster(tmp_path, "127.0.0.1", extra=COMPOSED) as cluster:
        assert httpx.get(cluster.node0.url + "/get_server_info", timeout=10).json()["mesh"] == COMPOSED_SPEC
        for i, p in enumerate(PROMPTS):
            assert generate(cluster.node0, p, rank=i)["output_ids"] == reference[p], (p, i)
        check_flush(cluster.node0, [(range(4), "node 0 (ranks 0-3)"), (range(4, 8), "node 1 (ranks 4-7)")])


@pytest.mark.slow  # the same two nodes as above, over ::1 (18 s)
@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_two_nodes_over_ipv6(tmp_path, reference):
    with Cluster(tmp_path, "::1") as cluster:
        check_same_as_single_process(cluster, reference)
        cluster.node0.stop()  # node 0 leaves in order: node 1 ends by itself
        assert cluster.node1.proc.wait(timeout=TIMEOUT + 10) == 0
        assert "node 0 shut down" in cluster.node1.log.read_text()


# ---- start-up mistakes end in one line ----------------------------------------------------------------


def run_serve(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxdp.serve", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=timeout, env=NODE_ENV)


def test_start_up_mistakes():
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        cases = [
            (["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{port}"], "cannot listen on port"),
            (["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{free_port()}",
              "--dist-init-timeout", "2"], "could not reach node 0"),
            (["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "::1:5000"], "in brackets"),
            (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000"], "--node-rank 2"),
            (["--nnodes", "2"], "needs --dist-init-addr"),
            (["--nnodes", "3", "--dist-init-addr", "127.0.0.1:5000"], "do not split evenly"),
        ]
        for args, words in cases:
            t0 = time.monotonic()
            r = run_serve(["--mesh", "dp=8", *args])
            assert r.returncode == 2, (args, r.stderr[-2000:])
            last = r.stderr.strip().splitlines()[-1]
            assert last.startswith("error: ") and words in last, (args, last)
            assert "Traceback" not in r.stderr
            assert time.monotonic() - t0 < 50
    finally:
        busy.close()


def test_parse_dist_addr():
    assert parse_dist_addr("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_dist_addr("node0:5000") == ("node0", 5000)
    assert parse_dist_addr("[::1]:5000") == ("::1", 5000)
    for bad in ("node0", "node0:http", "[::1]", "::1:5000", "[nope]:5000", ":5000", "h:70000"):
        with pytest.raises(DistError):
            parse_dist_addr(bad)


# ---- the exchange, against a fake key-value store ------------------------------------------------------


@pytest.mark.slow  # two nodes speculating (MTP) under dp=8: the single process's greedy tokens
def test_two_nodes_speculating_match_single_process(tmp_path, reference):
    with Cluster(tmp_path, "127.0.0.1", extra=("--speculative-algorithm", "EAGLE")) as cluster:
        for i, p in enumerate(PROMPTS):  # four on node 0's ranks, four on node 1's
            out = generate(cluster.node0, p, rank=i)
            assert out["output_ids"] == reference[p], (p, i)
            assert out["meta_info"]["spec_verify_ct"] >= 1
        info = httpx.get(cluster.node0.url + "/get_server_info", timeout=10).json()
        assert info["avg_spec_accept_length"] > 1.0
