"""Several nodes: two processes with 4 CPU devices each on loopback form one `--mesh dp=8` model world.

Completions through node 0 equal the single-process dp=8 server's greedy outputs, for requests pinned to
ranks 0-3 (node 0) and 4-7 (node 1), over IPv4 and over IPv6 (`--dist-init-addr [::1]:PORT`), and under
dp=4,tp=2 (two whole TP groups per node). Killing node 1 mid-load, or stalling it (SIGSTOP), makes node 0
fail its requests and refuse new ones (503) within `--dist-timeout`; stopping node 0 ends node 1.
Start-up mistakes end in one line. The exchange itself is checked against a fake key-value store (every
node reaches the same proposals; a silent node raises PeerFailure within the timeout).
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from servers import Server, free_port

from jaxdp.engine.hosts import DistError, HostExchange, PeerFailure, parse_dist_addr
from jaxdp.model.loader import default_model_path
from jaxdp.parallel.places import Proposal

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

    def __init__(self, tmp, host: str, mesh: str = "dp=8"):
        addr = f"[{host}]:{free_port()}" if ":" in host else f"{host}:{free_port()}"
        common = ["--mesh", mesh, "--nnodes", "2", "--dist-init-addr", addr, "--dist-timeout", str(TIMEOUT), *ARGS]
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
        assert "node 1 did not answer" in cluster.node0.log.read_text()


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
        assert answer.status_code == 503 and "no answer from the other nodes" in answer.json()["error"]["message"]
        # node 1, running again, finds node 0 gone from the exchange and ends by itself with a message
        assert cluster.node1.proc.wait(timeout=3 * TIMEOUT) == 1
        assert "error: node 1:" in cluster.node1.log.read_text()


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


class FakeStore:
    """The distributed runtime's key-value calls the exchange uses, in one process."""

    def __init__(self):
        self.data, self.cond = {}, threading.Condition()

    def key_value_set_bytes(self, key, value):
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.data[key]

    def key_value_delete(self, key):  # a key, or a directory and everything under it
        with self.cond:
            for k in [k for k in self.data if k == key or k.startswith(key + "/")]:
                del self.data[k]


def test_exchange_gives_every_node_the_same_proposals_and_messages():
    store, nodes, dp = FakeStore(), 4, 8
    results = [None] * nodes

    def node(k):
        ex = HostExchange(nodes, k, dp, timeout_s=5, client=store)
        out = []
        for step in range(200):
            local = [Proposal(0, False, False)] * dp
            for r in ex.local_ranks():
                local[r] = Proposal(10 * step + r, r % 2 == 0, True)
            out.append(ex.exchange(local, {"from": k, "step": step}))
        results[k] = out

    threads = [threading.Thread(target=node, args=(k,)) for k in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for step in range(200):
        proposals = [results[k][step][0] for k in range(nodes)]
        assert all(p == proposals[0] for p in proposals)
        assert [p.rows for p in proposals[0]] == [10 * step + r for r in range(dp)]
        for k in range(nodes):
            assert [m["from"] for m in results[k][step][1]] == list(range(nodes))
    # the keys of finished iterations are deleted, a directory of BLOCK at a time
    assert len(store.data) <= 2 * HostExchange.BLOCK * nodes
    assert max(pickle.loads(v)[1]["step"] for v in store.data.values()) == 199


def test_a_silent_node_fails_the_exchange_within_the_timeout():
    store = FakeStore()
    ex = HostExchange(2, 0, 8, timeout_s=0.5, client=store)
    t0 = time.monotonic()
    with pytest.raises(PeerFailure, match="node 1 did not answer"):
        ex.exchange([Proposal(0, False, False)] * 8, {})
    assert time.monotonic() - t0 < 2
