"""`python -m jaxdp.bench.client_cost`: what the benchmark client itself costs, against a server that costs nothing.

A server that answers every streamed `/generate` at once with `--output-len` SSE events (a raw asyncio server in a
process of its own, on `--server-cpus`) takes C requests at once from the client on `--client-cpus`, once with
`jaxdp.bench.serving`'s client (aiohttp) and once with the same loop over httpx (what that client used before). For
each: when the requests reach the server (first, median, last, from the moment the client starts, its session
included), the round's duration and the client's CPU per token. Until a request is on the wire the server under test
can only wait, so this is the part of `python -m jaxdp.bench.versus`'s server figure that belongs to the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jaxdp.bench import serving
from jaxdp.net import free_port


def null_server(port: int, cpus: set[int], events: int, arrivals) -> None:
    """Answer each request with `events` token events and [DONE]; put each request's arrival time on the queue."""
    os.sched_setaffinity(0, cpus)
    event = b'data: {"meta_info": {"completion_tokens": %d}}\n\n'
    body = b"".join(event % (i + 1) for i in range(events)) + b"data: [DONE]\n\n"
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrivals.put(time.perf_counter())
                length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                writer.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    asyncio.run(main())


async def httpx_round(args, reqs: list[serving.Request]) -> tuple[float, int]:
    """`serving.run_point`'s loop over httpx's streaming client (its line reader, the same parse per event)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        async def one(req: serving.Request) -> int:
            path, body = serving.request_body(args, req)
            seen = 0
            async with client.stream("POST", args.base_url + path, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        seen = json.loads(line[5:])["meta_info"]["completion_tokens"]
            return seen

        t0 = time.perf_counter()
        seen = await asyncio.gather(*[one(r) for r in reqs])
        return time.perf_counter() - t0, sum(seen)


def measure(form: str, args, reqs, arrivals) -> dict:
    c0, t0 = time.process_time(), time.perf_counter()
    if form == "aiohttp":
        point = asyncio.run(serving.run_point(args, reqs, len(reqs), float("inf")))
        duration, tokens = point["duration_s"], point["total_output_tokens"]
    else:
        duration, tokens = asyncio.run(httpx_round(args, reqs))
    cpu = time.process_time() - c0
    try:
        at = np.sort([arrivals.get(timeout=10) for _ in reqs]) - t0
    except queue.Empty:
        raise SystemExit(f"error: the null server did not see every request of the {form} client") from None
    return {"client": form, "first_arrival_ms": 1e3 * at[0], "median_arrival_ms": 1e3 * float(np.median(at)),
            "last_arrival_ms": 1e3 * at[-1], "duration_ms": 1e3 * duration,
            "client_cpu_us_per_token": 1e6 * cpu / max(1, tokens), "output_tokens": tokens}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.client_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    every = sorted(os.sched_getaffinity(0))
    ap.add_argument("--server-cpus", default=str(every[0]), help="CPUs of the null server (default: the first)")
    ap.add_argument("--client-cpus", default=str(every[-1]), help="CPUs of the client (default: the last)")
    ap.add_argument("--json", default="bench_client_cost.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    port = free_port()
    arrivals = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=null_server, daemon=True, args=(
        port, {int(c) for c in a.server_cpus.split(",")}, a.output_len, arrivals))
    server.start()
    args = serving.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(a.concurrency),
                               "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
                               "--random-range-ratio", "1", "--disable-tqdm", "--warmup-requests", "0"])
    reqs = serving.random_requests(args, np.random.default_rng(0))
    os.sched_setaffinity(0, {int(c) for c in a.client_cpus.split(",")})
    deadline = time.monotonic() + 30
    while True:  # the server is up once it accepts a connection
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                print("error: the null server did not start", file=sys.stderr)
                return 2
            time.sleep(0.1)
    rounds = [measure(form, args, reqs, arrivals) for _ in range(a.rounds) for form in ("aiohttp", "httpx")]
    server.kill()
    med = {form: {k: statistics.median(r[k] for r in rounds if r["client"] == form)
                  for k in rounds[0] if k != "client"} for form in ("aiohttp", "httpx")}
    print(f"{a.concurrency} streams at once, {a.output_len} events each; null server on CPUs {a.server_cpus}, client "
          f"on {a.client_cpus} (medians of {a.rounds})")
    print("| client | first request arrives | median | last | round | client CPU per token |")
    print("|---|---|---|---|---|---|")
    for form, m in med.items():
        print(f"| {form} | {m['first_arrival_ms']:.0f} ms | {m['median_arrival_ms']:.0f} ms | "
              f"{m['last_arrival_ms']:.0f} ms | {m['duration_ms']:.0f} ms | {m['client_cpu_us_per_token']:.1f} us |")
    Path(a.json).write_text(json.dumps({"args": vars(a), "rounds": rounds, "medians": med}, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
