"""`python -m jaxdp.bench.disagg`: how fast a request's KV moves from a prefill server's pool to a decode
server's, through `jaxdp.disagg` (read from the prefill rank's pages, offered on JAX's transfer server,
fetched by another process, written at the decode rank's pages), for prompts of 1k and 8k tokens.

Two processes on this machine, each its own pool of the model's KV format (default: DeepSeek-V3's, 61
layers of 512 + 64 latent values in bf16, about 69 KiB a token; `--layers`, `--width`, `--dtype` for
another), page size 16 on the prefill side and 32 on the decode side (the hand-off maps one onto the
other). Prints a table of each phase's time and the transfer's GB/s; `--json` writes the rounds.

    python -m jaxdp.bench.disagg --tokens 1024 8192 --rounds 3 --json benchmarks/results/disagg_transfer.json

`--servers`: the same hand-off between real servers, and the share of the time to first token it takes. A
prefill server and a decode server (`python -m jaxdp.serve --disaggregation-mode prefill|decode`, `--mesh dp=1`
each, the default model unless `--model-path`) and one colocated server; for each prompt length, a prompt of
random token ids (new each round: no prefix-cache hit) goes to the prefill and the decode server at once with
one bootstrap room (what SGLang's router does), and to the colocated server alone. Measured per round: the
colocated TTFT, the prefill server's answer (reading the prompt, the first token, the KV offered), the decode
server's first streamed token (the disaggregated TTFT), the hand-off (the decode server's first token after the
prefill server's answer: its pull, its write into the pool, its next step) and, from the decode server's
/metrics, the pull's milliseconds and bytes (GB/s).

    python -m jaxdp.bench.disagg --servers --tokens 1024 8192 --rounds 3 --json benchmarks/results/disagg_ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxdp.bench.launch import free_port, stop, wait_healthy
from jaxdp.disagg.bootstrap import BootstrapClient, BootstrapServer, PrefillInfo, RoomBoard
from jaxdp.disagg.kv import KVFormat, read_request_kv, write_request_kv
from jaxdp.disagg.transfer import JaxTransport


def _pool(layers: int, width: int, dtype, page_size: int, tokens: int, seed: int | None) -> dict:
    mesh = jax.make_mesh((1, 1), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:1])
    pages = -(-tokens // page_size) + 1
    shape = (1, layers, pages, page_size, width)
    if seed is None:
        x = jnp.zeros(shape, dtype)
    else:
        x = jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)
    return {"moe": jax.device_put(x, NamedSharding(mesh, P("dp")))}


def sender(args) -> None:
    """The prefill side: a pool holding the longest prompt, each round's request read and offered."""
    longest = max(args.tokens)
    cache = _pool(args.layers, args.width, args.dtype, 16, longest, seed=0)
    fmt = KVFormat.of(cache, args.chunk_tokens)
    transport, board = JaxTransport(), RoomBoard()
    server = BootstrapServer(PrefillInfo("bench", fmt.to_json(), 1, transport.name, transport.address()), board,
                             "127.0.0.1", args.port)
    rng = np.random.default_rng(0)
    pages = rng.permutation(-(-longest // 16) + 1).tolist()  # a request's pages are scattered in the pool
    print("ready", flush=True)
    for line in sys.stdin:  # "ROOM TOKENS" per round, from the receiver
        room, n = map(int, line.split())
        t0 = time.perf_counter()
        chunks = read_request_kv(cache, 0, pages, n, fmt)
        jax.block_until_ready(chunks)
        t1 = time.perf_counter()
        transport.offer(room, chunks, timeout_s=120)
        board.publish(room, {"status": "ready", "rank": 0, "n_tokens": n, "read_ms": (t1 - t0) * 1e3,
                             "offer_ms": (time.perf_counter() - t1) * 1e3})
    server.close()


def receiver(args) -> list[dict]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxdp.bench.disagg", "--role", "sender", "--port", str(port),
                             "--layers", str(args.layers), "--width", str(args.width), "--dtype", args.dtype,
                             "--chunk-tokens", str(args.chunk_tokens), "--tokens", *map(str, args.tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit("disagg: the sender process did not start")
    client = BootstrapClient()
    info = client.info("127.0.0.1", port)
    fmt = KVFormat.from_json(info.kv)
    cache = _pool(args.layers, args.width, args.dtype, 32, max(args.tokens), seed=None)
    transport = JaxTransport()
    device = jax.devices()[0]
    rows = []
    try:
        for r in range(args.rounds + 1):  # round 0 compiles the gather and scatter: not reported
            for n in args.tokens:
                room = r * 1000 + n
                t0 = time.perf_counter()
                proc.stdin.write(f"{room} {n}\n")
                proc.stdin.flush()
                outcome = client.room("127.0.0.1", port, room, wait_s=60)
                t1 = time.perf_counter()
                chunks = transport.fetch(info.address, room, fmt.specs(n, SingleDeviceSharding(device)), 120)
                t2 = time.perf_counter()
                pages = list(range(-(-n // 32)))
                cache = write_request_kv(cache, 0, pages, n, fmt, chunks)
                jax.block_until_ready(cache)
                t3 = time.perf_counter()
                if r == 0:
                    continue
                nbytes = fmt.nbytes(n)
                rows.append({"tokens": n, "bytes": nbytes, "read_ms": outcome["read_ms"],
                             "ready_ms": (t1 - t0) * 1e3, "fetch_ms": (t2 - t1) * 1e3, "write_ms": (t3 - t2) * 1e3,
                             "total_ms": (t3 - t0) * 1e3, "fetch_gb_s": nbytes / (t2 - t1) / 1e9,
                             "end_to_end_gb_s": nbytes / (t3 - t0) / 1e9})
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    return rows


SERVER_FLAGS = ["--mesh", "dp=1", "--page-size", "16", "--chunked-prefill-size", "2048", "--max-running-requests",
                "8", "--disable-cuda-graph", "--disaggregation-timeout", "120"]  # (compiled by the warm round)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _first_token_s(url: str, body: dict, t0: float) -> float:
    """Seconds from t0 to the first streamed token of /generate."""
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"disagg: {url} answered {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - t0
    raise SystemExit(f"disagg: {url} streamed no token")


def serve_rounds(args) -> list[dict]:
    """The hand-off between real servers (see the module's docstring), `args.rounds` rounds after a warm one."""
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    context = max(args.tokens) + 64
    common = [*SERVER_FLAGS, "--context-length", str(context), "--max-total-tokens", str(2 * context),
              *(["--model-path", args.model_path] if args.model_path else [])]
    bootstrap = free_port()
    roles = {"prefill": ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)],
             "decode": ["--disaggregation-mode", "decode"], "colocated": []}
    procs, urls = {}, {}
    try:
        for name, extra in roles.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            with (logs / f"disagg-{name}.log").open("w") as log:
                procs[name] = subprocess.Popen([sys.executable, "-m", "jaxdp.serve", *common, *extra, "--port",
                                                str(port)], stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)
        for name, proc in procs.items():
            wait_healthy(proc, urls[name], logs / f"disagg-{name}.log", 900, name=f"the {name} server")
        rng = np.random.default_rng(0)
        rows = []
        for r in range(args.rounds + 1):  # round 0 warms each length up (its first prompts): not reported
            for n in args.tokens:
                ids = rng.integers(1, 500, size=n).tolist()
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
                t0 = time.perf_counter()
                colocated = _first_token_s(urls["colocated"], body, t0)
                pulled = {k: _metric(urls["decode"], k) for k in ("jaxdp:kv_transfer_latency_ms_sum",
                                                                  "jaxdp:kv_transfer_bytes_total")}
                room = int(rng.integers(0, 2**62))
                pd = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
                with ThreadPoolExecutor(2) as pool:
                    t0 = time.perf_counter()
                    first = pool.submit(_first_token_s, urls["decode"], pd, t0)
                    answer = httpx.post(urls["prefill"] + "/generate", json=pd, timeout=600)
                    prefill_s = time.perf_counter() - t0
                    ttft = first.result()
                if answer.status_code != 200:
                    raise SystemExit(f"disagg: the prefill server answered {answer.status_code}: {answer.text[:300]}")
                pull_ms = _metric(urls["decode"], "jaxdp:kv_transfer_latency_ms_sum") - \
                    pulled["jaxdp:kv_transfer_latency_ms_sum"]
                nbytes = _metric(urls["decode"], "jaxdp:kv_transfer_bytes_total") - \
                    pulled["jaxdp:kv_transfer_bytes_total"]
                if r == 0:
                    continue
                handoff = max(ttft - prefill_s, 0.0)
                rows.append({"tokens": n, "bytes": nbytes, "colocated_ttft_ms": colocated * 1e3,
                             "prefill_ms": prefill_s * 1e3, "disagg_ttft_ms": ttft * 1e3,
                             "handoff_ms": handoff * 1e3, "pull_ms": pull_ms, "pull_gb_s": nbytes / pull_ms / 1e6,
                             "handoff_share": handoff / ttft, "pull_share": pull_ms / 1e3 / ttft})
        return rows
    finally:
        for proc in procs.values():
            stop(proc)


def _print_servers(rows: list[dict], tokens: list[int]) -> None:
    print(f"{'tokens':>7} {'KV MiB':>7} {'colocated TTFT':>15} {'prefill':>8} {'disagg TTFT':>12} {'hand-off':>9} "
          f"{'pull':>7} {'pull GB/s':>10} {'hand-off share':>15}")
    for n in tokens:
        mine = [r for r in rows if r["tokens"] == n]
        med = {k: float(np.median([r[k] for r in mine])) for k in mine[0]}
        print(f"{n:>7} {med['bytes'] / 2**20:>7.1f} {med['colocated_ttft_ms']:>12.0f} ms {med['prefill_ms']:>5.0f} ms "
              f"{med['disagg_ttft_ms']:>9.0f} ms {med['handoff_ms']:>6.0f} ms {med['pull_ms']:>4.0f} ms "
              f"{med['pull_gb_s']:>10.2f} {100 * med['handoff_share']:>14.0f}%")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.disagg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--servers", action="store_true", help="real servers: the hand-off's share of TTFT")
    ap.add_argument("--model-path", help="--servers: the model (default: the embedded default model)")
    ap.add_argument("--log-dir", default="bench-logs", help="--servers: the servers' logs")
    ap.add_argument("--role", choices=["receiver", "sender"], default="receiver", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "sender":
        return sender(args)
    if args.servers:
        rows = serve_rounds(args)
        _print_servers(rows, args.tokens)
    else:
        rows = receiver(args)
        _print_pieces(rows, args.tokens)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        kept = {k: v for k, v in vars(args).items() if k not in ("json", "role", "port", "log_dir")}
        args.json.write_text(json.dumps({"args": kept, "load_average": os.getloadavg(), "rounds": rows}, indent=1))


def _print_pieces(rows: list[dict], tokens: list[int]) -> None:
    print(f"{'tokens':>7} {'MiB':>8} {'read ms':>8} {'ready ms':>9} {'fetch ms':>9} {'write ms':>9} "
          f"{'fetch GB/s':>11} {'end-to-end GB/s':>16}")
    for n in tokens:
        mine = [r for r in rows if r["tokens"] == n]
        med = {k: float(np.median([r[k] for r in mine])) for k in mine[0]}
        print(f"{n:>7} {med['bytes'] / 2**20:>8.1f} {med['read_ms']:>8.1f} {med['ready_ms']:>9.1f} "
              f"{med['fetch_ms']:>9.1f} {med['write_ms']:>9.1f} {med['fetch_gb_s']:>11.2f} "
              f"{med['end_to_end_gb_s']:>16.2f}")


if __name__ == "__main__":
    main()
