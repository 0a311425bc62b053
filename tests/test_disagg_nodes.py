"""Prefill/decode disaggregation with several nodes on either side (issue 30): a prefill server of two nodes
(`--mesh dp=4`, two processes of 2 host devices each: ranks 0-1 on node 0, 2-3 on node 1) and a decode server of
two nodes (the same), each request sent to both node 0s with one bootstrap room, as SGLang's router sends it.

The prefill rank (the room modulo 4) and the decode rank (pinned) cover every pair of nodes: node 1 of the prefill
server offers its ranks' KV on its own transfer server and its rooms reach the bootstrap endpoint on node 0 through
the node exchange; node 1 of the decode server pulls its ranks' KV and writes it into its own pool shards. The
greedy outputs equal one colocated engine's, every KV is pulled once, no offer stays in flight, and every page is
back on every rank of both servers; the same into a one-node decode server `--mesh tp=4` of another page size.
The same behind SGLang's router (sglang-router 0.3.2, installed as
tests/test_disagg_router.py installs it), through /v1/completions streamed and not. Last, a stalled prefill node:
the decode server ends the requests waiting for its rooms in one sentence within the prefill server's
--dist-timeout.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from servers import Server, completion_text

from jaxdp.model.loader import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (default_model_path() / "tokenizer.json").exists(),
                                                   reason="needs the default model")]

SERVER = ["--chunked-prefill-size", "128", "--page-size", "16", "--max-total-tokens", "2048", "--max-running-requests",
          "16", "--cuda-graph-bs", "4", "--decode-log-interval", "50"]
COMMON = [*SERVER, "--mesh", "dp=4", "--nnodes", "2", "--dist-timeout", "30"]
DECODE = ["--disaggregation-mode", "decode", "--disaggregation-timeout", "120"]
NODE_ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
PROMPTS = ["37+48=", "12+34=" * 12 + "91-17=", "sort 3142=", "reverse abcde=" * 6, "count a abcab=",
           "6*7=" + "123*4=" * 9, "reverse xyz=", "sort 4213=" * 15]  # 4 to about 150 tokens
MAX_NEW = 8


def distinct_ports(n: int) -> list[int]:
    """n free ports, all different (free_port() twice in a row may give the same one: nothing holds it between)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class TwoNodes:
    """Node 0 (HTTP) and node 1 of one server of two nodes; `dist_port`: node 0's --dist-init-addr port."""

    def __init__(self, logs, name: str, dist_port: int, *flags: str):
        common = [*COMMON, "--dist-init-addr", f"127.0.0.1:{dist_port}", *flags]
        self.node0 = Server([*common, "--node-rank", "0"], logs / f"{name}-node0.log", env=NODE_ENV)
        self.node1 = Server([*common, "--node-rank", "1"], logs / f"{name}-node1.log", env=NODE_ENV)

    def wait(self) -> None:
        self.node0.wait(600), self.node1.wait(600)

    def stop(self) -> None:
        self.node0.stop()
        self.node1.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-nodes")
    bootstrap, prefill_dist, decode_dist = distinct_ports(3)
    prefill = TwoNodes(logs, "prefill", prefill_dist, "--disaggregation-mode", "prefill",
                       "--disaggregation-bootstrap-port", str(bootstrap), "--disaggregation-timeout", "60")
    decode = TwoNodes(logs, "decode", decode_dist, *DECODE)
    decode_tp = Server([*SERVER, "--mesh", "tp=4", "--page-size", "8", *DECODE], logs / "decode-tp4.log")
    try:
        prefill.wait()
        decode.wait()
        decode_tp.wait(600)
        yield prefill, decode, bootstrap, decode_tp
    finally:
        prefill.stop()
        decode.stop()
        decode_tp.stop()


@pytest.fixture(scope="module")
def expected():
    """One colocated engine's greedy answers."""
    from jaxdp.engine import Engine, SamplingParams

    engine = Engine("default", "dp=1")
    try:
        reqs = engine.generate([engine.tokenizer.encode(p) for p in PROMPTS],
                               SamplingParams(max_new_tokens=MAX_NEW, temperature=0))
        return [r.output_ids for r in reqs]
    finally:
        engine.shutdown()


def _both(prefill: Server, decode: Server, bootstrap: int, i: int, prompt: str) -> dict:
    """What SGLang's router does: the same body to both servers at once, with one bootstrap room; the decode
    server's answer. Room i: prefill rank i % 4; decode rank (i + 1) % 4 (pinned)."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 4 * (1000 + i) + i % 4}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, prefill.url + "/generate", json=body, timeout=300)
        d = pool.submit(httpx.post, decode.url + "/generate", json={**body, "routed_dp_rank": (i + 1) % 4},
                        timeout=300)
        rp, rd = p.result(), d.result()
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    assert rp.json()["meta_info"]["dp_rank"] == i % 4
    assert rd.json()["meta_info"]["dp_rank"] == (i + 1) % 4
    return rd.json()


def _states(server: Server) -> list[dict]:
    return httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"]


def _settled(server: Server, timeout: float = 30) -> list[dict]:
    """Every rank's figures once every page is free or cached and no request is left (node 1's as of its last
    report: waits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        states = _states(server)
        ok = all(s["free_pages"] + s["cached_pages"] == s["num_pages"] and s["num_reqs"] == 0 for s in states)
        if ok or time.monotonic() > deadline:
            return states
        time.sleep(0.3)


def test_two_node_prefill_and_decode_servers_answer_as_one_engine(servers, expected):
    prefill, decode, bootstrap = servers[0].node0, servers[1].node0, servers[2]
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda a: _both(prefill, decode, bootstrap, *a), enumerate(PROMPTS)))
    print(f"{len(PROMPTS)} requests in {time.monotonic() - t0:.1f} s")
    assert [g["output_ids"] for g in got] == expected
    for server, mode in ((prefill, "prefill"), (decode, "decode")):
        states = _settled(server)
        assert [s["dp_rank"] for s in states] == [0, 1, 2, 3]
        for s in states:
            assert s["free_pages"] + s["cached_pages"] == s["num_pages"] and s["num_reqs"] == 0, (mode, s)
            d = s["disagg"]
            assert d["mode"] == mode and d["transfers"] == 2, (mode, s)  # every rank's two requests, node 1's too
            if mode == "decode":
                assert d["prealloc"] == d["transfer"] == d["bootstrap_failed"] == d["transfer_failed"] == 0, s
                print(f"decode rank {s['dp_rank']} (node {s['dp_rank'] // 2}): {d['transfers']} pulls, "
                      f"{d['bytes'] / 2**20:.2f} MiB in {d['seconds'] * 1e3:.1f} ms, "
                      f"{d['bytes'] / max(d['seconds'], 1e-9) / 1e6:.1f} MB/s")
    deadline = time.monotonic() + 10  # the last "taken" reaches node 0's bootstrap endpoint after the answers
    while any(s["disagg"]["inflight"] for s in _states(prefill)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(s["disagg"]["inflight"] == 0 and s["disagg"]["dropped"] == 0 for s in _states(prefill))


def test_a_two_node_prefill_server_hands_over_to_a_one_node_tp_decode_server(servers, expected):
    """Layouts differ and so do node counts: prefill dp=4 over two nodes (page size 16), decode tp=4 on one node
    (page size 8): every prefill rank's KV, node 1's too, lands in the one tp group's pool."""
    prefill, _, bootstrap, decode_tp = servers

    def one(a):
        i, prompt = a
        body = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 4 * (3000 + i) + i % 4}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            p = pool.submit(httpx.post, prefill.node0.url + "/generate", json=body, timeout=300)
            d = pool.submit(httpx.post, decode_tp.url + "/generate", json=body, timeout=300)
            assert p.result().status_code == 200, p.result().text
            assert d.result().status_code == 200, d.result().text
            return d.result().json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(one, enumerate(PROMPTS))) == expected
    (state,) = _settled(decode_tp)
    assert state["free_pages"] + state["cached_pages"] == state["num_pages"] and state["num_reqs"] == 0, state
    assert state["disagg"]["transfers"] == len(PROMPTS) and state["disagg"]["transfer_failed"] == 0, state
    for s in _settled(prefill.node0):
        assert s["free_pages"] + s["cached_pages"] == s["num_pages"] and s["num_reqs"] == 0, s


def _completion(url: str, prompt: str, stream: bool) -> str:
    return completion_text(url, prompt, MAX_NEW, stream, timeout=300)


def test_behind_sglangs_router(servers, expected, tmp_path):
    """The same two servers behind SGLang's router (its own bootstrap rooms, so its own choice of prefill ranks;
    the decode server's controller picks the decode ranks), through /v1/completions, streamed and not."""
    from test_disagg_router import Router

    from jaxdp.tokenizer import Tokenizer

    prefill, decode, bootstrap, _ = servers
    tok = Tokenizer(default_model_path())
    want = [tok.decode(ids, skip_special_tokens=True) for ids in expected]
    router = Router(prefill.node0, bootstrap, decode.node0.url, tmp_path / "router.log")
    try:
        router.wait()
        with concurrent.futures.ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
            got = list(pool.map(lambda a: _completion(router.url, a[1], stream=a[0] % 2 == 1),
                                enumerate(PROMPTS * 2)))
    finally:
        router.stop()
    assert got == want * 2
    for server in (prefill.node0, decode.node0):
        for s in _settled(server):
            assert s["free_pages"] + s["cached_pages"] == s["num_pages"] and s["num_reqs"] == 0, s


def test_a_stalled_prefill_node_ends_the_decode_sides_requests_in_one_sentence(servers):
    """Last (it breaks the prefill server): node 1 of the prefill server stops (SIGSTOP) while requests for its
    ranks and node 0's come in. Node 0 fails within --dist-timeout and refuses every room it had, so the decode
    server ends each request with one sentence naming node 1, long before its own --disaggregation-timeout
    (120 s), and every page of the decode server is back."""
    prefill, decode, bootstrap, _ = servers
    parent = prefill.node1.proc.pid  # node 1 runs as the child of a small supervisor
    node1 = int(Path(f"/proc/{parent}/task/{parent}/children").read_text().split()[0])
    os.kill(node1, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        rooms = [4 * 2000 + 2, 4 * 2001 + 3, 4 * 2002 + 0]  # prefill ranks 2 and 3 (node 1), 0 (node 0)
        with concurrent.futures.ThreadPoolExecutor(2 * len(rooms)) as pool:
            futures = []
            for i, room in enumerate(rooms):
                body = {"text": PROMPTS[i], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0},
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
                pool.submit(httpx.post, prefill.node0.url + "/generate", json=body, timeout=300)
                futures.append(pool.submit(httpx.post, decode.node0.url + "/generate",
                                           json={**body, "routed_dp_rank": (i + 2) % 4}, timeout=300))
            answers = [f.result() for f in futures]
        took = time.monotonic() - t0
        for a in answers:
            assert a.status_code == 503, a.text
            message = a.json()["error"]["message"]
            assert "the prefill server stopped serving" in message and "node 1" in message, message
        print(f"the decode side's requests ended {took:.1f} s after they came")
        assert took < 90, took  # the prefill server's --dist-timeout (30 s), not the decode side's 120 s
        for s in _settled(decode.node0):
            assert s["free_pages"] + s["cached_pages"] == s["num_pages"] and s["num_reqs"] == 0, s
            assert s["disagg"]["bootstrap_failed"] == (1 if s["dp_rank"] in (2, 3, 0) else 0), s
    finally:
        os.kill(node1, signal.SIGKILL)
