"""`python -m jaxdp.bench.versus`: the server against the offline engine at the same load, side by side in one run.

The same load (C requests at once, random token ids, fixed prompt and output lengths, greedy, the same pools
and decode buckets) runs on the offline engine (`python -m jaxdp.bench.engine --rounds-on-demand` in a child
process: `Engine.generate`, no server) and on `python -m jaxdp.serve` driven by the streaming client of
`python -m jaxdp.bench` (native `/generate`, an SSE event per token), round for round: offline, server,
offline, server, ..., offline. Each server round is set against the mean of the offline rounds just before
and after it, and the ratio reported is the median of those, so the machine's drift over minutes (the
offline engine alone moves by 10-20% between runs on a shared host) falls out of it.

The client runs in this process. By default the engine and the server get the same CPUs (all but the last)
and the client gets the last one (`--engine-cpus`, `--client-cpus`; `--no-pin` lets everything share every
CPU), so what the client costs is not taken from the server: the ratio is what the server's own path (HTTP,
SSE, the event loop, the hop from the loop thread) costs against the engine alone. The server runs its engine
in a child process (the default on one node): that process keeps the engine's CPUs and the server's HTTP
process moves to the client's (`--http-cpus`), as its own core would on a GPU node. `--with-in-process`
measures the server a second time with `--no-engine-process` (HTTP and the engine in one process, on the
engine's CPUs), against the same offline engine. The client's and the server's CPU seconds per output token
(both processes) are reported beside it, by thread; `python -m jaxdp.bench.client_cost` measures what the
client alone costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from jaxdp.bench import serving
from jaxdp.bench.cpu import child_pids, process_cpu_seconds, thread_cpu_seconds
from jaxdp.bench.launch import NotReady, wait_healthy
from jaxdp.layout import parse_mesh_spec
from jaxdp.net import free_port


def _cpus(spec: str | None, default: set[int]) -> set[int]:
    return default if spec is None else {int(c) for c in spec.split(",")}


def _pinned(cpus: set[int] | None):
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def server_steps(port: int) -> dict[str, float]:
    """Steps the server has run so far, by kind (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "jaxdp:steps":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["kind"]] = out.get(sample.labels["kind"], 0) + sample.value
    return out


def shape(args) -> dict:
    """The pools and buckets `jaxdp.bench.engine` gives this load (per rank), for the server to match."""
    per_rank = max(1, args.concurrency // args.dp)
    ctx = args.input_len + args.output_len
    pages = per_rank * -(-ctx // args.page_size) + 8
    buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= per_rank} | {per_rank})
    return {"per_rank": per_rank, "pages": pages, "buckets": buckets, "context": ctx + args.page_size}


class Offline:
    """The offline engine in a child process on the engine's CPUs, built once; `round()` runs the load once."""

    def __init__(self, args, cpus: set[int] | None):
        cmd = [sys.executable, "-m", "jaxdp.bench.engine", "--model-path", args.model_path, "--meshes", args.mesh,
               "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--page-size", str(args.page_size),
               "--chunk-per-rank", str(args.chunk_per_rank), "--rounds-on-demand"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=_pinned(cpus))
        if not any(line.strip() == "ready" for line in self.proc.stdout):
            raise SystemExit(f"error: the offline engine exited ({self.proc.wait()}) before it was ready")

    def round(self) -> dict:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: the offline engine exited ({self.proc.wait()}) during a round")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def start_server(args, flags: list[str], cpus: set[int] | None, port: int, log: Path) -> subprocess.Popen:
    s = shape(args)
    cmd = [sys.executable, "-m", "jaxdp.serve", "--model-path", args.model_path, "--mesh", args.mesh,
           "--port", str(port), "--page-size", str(args.page_size),
           "--max-total-tokens", str(s["pages"] * args.page_size), "--max-running-requests", str(args.concurrency),
           "--chunked-prefill-size", str(args.chunk_per_rank * args.dp), "--context-length", str(s["context"]),
           "--cuda-graph-bs", *map(str, s["buckets"]), *flags]
    proc = subprocess.Popen(cmd, preexec_fn=_pinned(cpus), stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, 600, poll_s=1)
    except NotReady as e:
        proc.kill()
        raise SystemExit(f"error: {e}") from None
    return proc


def serve_rounds(args, port: int, server: subprocess.Popen, offline: Offline) -> tuple[list[dict], list[dict]]:
    """`--rounds` rounds of the load on the server, each between two offline rounds: (server's, offline's)."""
    client_args = serving.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts",
                                      str(args.concurrency), "--max-concurrency", str(args.concurrency),
                                      "--random-input-len", str(args.input_len), "--random-output-len",
                                      str(args.output_len), "--random-vocab-size", str(args.vocab),
                                      "--disable-tqdm", "--warmup-requests", "0"])
    reqs = serving.random_requests(client_args, np.random.default_rng(args.seed))
    asyncio.run(serving.run_point(client_args, reqs[:8], 8, float("inf")))  # warm the connections
    rounds = []
    pids = [server.pid, *child_pids(server.pid)]  # its engine's process too (unless --no-engine-process)

    def cpu() -> float:
        return sum(process_cpu_seconds(p) for p in pids)

    def threads() -> dict[str, float]:
        per = [thread_cpu_seconds(p) for p in pids]
        return {(f"engine_process_{k}" if i else k): v for i, t in enumerate(per) for k, v in t.items()}

    offline_rounds = [offline.round()]
    for _ in range(args.rounds):
        c0, s0, k0, t0 = time.process_time(), cpu(), server_steps(port), threads()
        point = asyncio.run(serving.run_point(client_args, reqs, args.concurrency, float("inf")))
        c1, s1, k1, t1 = time.process_time(), cpu(), server_steps(port), threads()
        offline_rounds.append(offline.round())
        tokens = max(1, point["total_output_tokens"])
        around = statistics.fmean(r["tokens_per_s"] for r in offline_rounds[-2:])
        rounds.append({"tokens_per_s": point["output_throughput"], "offline_around_tok_s": around,
                       "server_over_offline": point["output_throughput"] / around, "failed": point["failed"],
                       "duration_s": point["duration_s"], "tpot_ms": point["tpot_ms"]["median"],
                       "client_cpu_us_per_token": 1e6 * (c1 - c0) / tokens,
                       "server_cpu_us_per_token": 1e6 * (s1 - s0) / tokens,
                       "client_cpu_share": (c1 - c0) / point["duration_s"],
                       "server_cpu_share": (s1 - s0) / point["duration_s"],
                       "server_threads_cpu_us_per_token": {k: 1e6 * (t1[k] - t0[k]) / tokens for k in t1},
                       "steps": {k: k1[k] - k0.get(k, 0) for k in k1}})
    return rounds, offline_rounds


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.versus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="tiny")
    ap.add_argument("--mesh", default="dp=8")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-per-rank", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3,
                    help="server rounds per form, each between two offline rounds (medians reported)")
    ap.add_argument("--vocab", type=int, default=512, help="prompt token ids are drawn below this")
    ap.add_argument("--engine-cpus", help="CPUs of the engine and the server, e.g. 0 (default: all but the last)")
    ap.add_argument("--client-cpus", help="CPUs of the client (default: the last)")
    ap.add_argument("--http-cpus", help="CPUs of the server's HTTP process when its engine runs in a process of "
                    "its own (default: the client's; the engine process keeps the engine's)")
    ap.add_argument("--no-pin", action="store_true", help="everything shares every CPU")
    ap.add_argument("--server-flag", action="append", default=[], help="one more flag for the server (repeatable)")
    ap.add_argument("--with-in-process", action="store_true",
                    help="measure the server a second time with --no-engine-process, against the same offline engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_versus.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    args.dp = parse_mesh_spec(args.mesh).dp
    every = sorted(os.sched_getaffinity(0))
    engine_cpus = client_cpus = None
    if not args.no_pin and len(every) > 1:
        engine_cpus, client_cpus = _cpus(args.engine_cpus, set(every[:-1])), _cpus(args.client_cpus, {every[-1]})
    forms = [args.server_flag] + ([[*args.server_flag, "--no-engine-process"]] if args.with_in_process else [])
    offline = Offline(args, engine_cpus)
    try:
        servers = [serve_one(args, flags, engine_cpus, client_cpus, every, offline) for flags in forms]
    finally:
        offline.close()
    result = {"args": vars(args), "engine_cpus": sorted(engine_cpus or every),
              "client_cpus": sorted(client_cpus or every),
              **servers[0],  # the server as given; with --with-in-process the second form follows
              "in_process": servers[1] if len(servers) > 1 else None,
              "load_average": os.getloadavg()}
    print(f"{args.mesh}, {args.concurrency} requests, {args.input_len} in / {args.output_len} out; engine on CPUs "
          f"{result['engine_cpus']}, client on {result['client_cpus']}")
    print("| server | where its HTTP side runs | offline (its rounds) | server | server / offline, round by round "
          "| median |")
    print("|---|---|---|---|---|---|")
    for flags, srv in zip(forms, servers, strict=True):
        where = f"process of its own, CPUs {srv['http_cpus']}" if srv["http_cpus"] else "the engine's process"
        ratios = ", ".join(f"{100 * r['server_over_offline']:.0f}%" for r in srv["server_rounds"])
        print(f"| {' '.join(flags) or 'as is'} | {where} | {srv['offline_tok_s']:,.1f} | {srv['server_tok_s']:,.1f} | "
              f"{ratios} | **{100 * srv['server_over_offline']:.0f}%** |")
    print(f"(output tok/s, medians of {args.rounds} rounds, each server round against the mean of the offline rounds "
          f"before and after it; load average {result['load_average'][0]:.2f} at the end)")
    for flags, srv in zip(forms, servers, strict=True):
        print(f"{' '.join(flags) or 'as is'}: client CPU {srv['client_cpu_us_per_token']:.1f} us per token, server "
              f"CPU {srv['server_cpu_us_per_token']:.1f} us per token; failed requests "
              f"{sum(r['failed'] for r in srv['server_rounds'])}; by thread: " + ", ".join(
                  f"{k.replace('_', ' ')} {v:.1f}" for k, v in srv["server_threads_cpu_us_per_token"].items()))
        print(f"  steps per run {[r['steps'] for r in srv['server_rounds']]}; offline: CPU by thread, us per token: "
              + ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in srv["offline_threads_cpu_us_per_token"].items())
              + f"; steps per run {srv['offline_steps']}")
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0


def serve_one(args, flags: list[str], engine_cpus, client_cpus, every: list[int], offline: Offline) -> dict:
    """Start the server with these flags, run its rounds between the offline engine's, stop it: the figures
    (medians over the rounds)."""
    split = "--no-engine-process" not in flags and client_cpus is not None
    http_cpus = _cpus(args.http_cpus, client_cpus) if split else None
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args, flags, engine_cpus, port, Path(tmp) / "server.log")
        try:
            if client_cpus is not None:
                os.sched_setaffinity(0, client_cpus)
            if http_cpus is not None:  # the engine runs in a child that keeps the engine's CPUs; HTTP moves
                for tid in os.listdir(f"/proc/{server.pid}/task"):
                    os.sched_setaffinity(int(tid), http_cpus)
            rounds, offline_rounds = serve_rounds(args, port, server, offline)
        finally:
            os.sched_setaffinity(0, set(every))
            server.terminate()
            server.wait(60)
    med = statistics.median
    return {"server_flags": flags, "http_cpus": sorted(http_cpus) if http_cpus else None, "server_rounds": rounds,
            "server_tok_s": med([r["tokens_per_s"] for r in rounds]),
            "server_over_offline": med([r["server_over_offline"] for r in rounds]),
            "offline_rounds_tok_s": [r["tokens_per_s"] for r in offline_rounds],
            "offline_tok_s": med([r["tokens_per_s"] for r in offline_rounds]),
            "offline_steps": [r["steps"] for r in offline_rounds],
            "offline_threads_cpu_us_per_token": {k: med([r["threads_cpu_us_per_token"][k] for r in offline_rounds])
                                                 for k in offline_rounds[0]["threads_cpu_us_per_token"]},
            "client_cpu_us_per_token": med([r["client_cpu_us_per_token"] for r in rounds]),
            "server_cpu_us_per_token": med([r["server_cpu_us_per_token"] for r in rounds]),
            "server_threads_cpu_us_per_token": {k: med([r["server_threads_cpu_us_per_token"][k] for r in rounds])
                                                for k in rounds[0]["server_threads_cpu_us_per_token"]}}


if __name__ == "__main__":
    sys.exit(main())
