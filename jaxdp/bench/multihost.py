"""`python -m jaxdp.bench.multihost`: what the per-step exchange between nodes costs, measured on one machine.

Two parts, both on loopback:

1. **The exchange alone**: `--nodes` processes join JAX's distributed runtime and run `--rounds` exchanges
   of `HostExchange` with the payload a busy engine sends (each node's ranks' proposals and states), over
   each `--transport`: ZeroMQ sockets (what the engine uses) and a jitted all-gather with JAX's gloo CPU
   collectives; node 0's time per exchange (send its
   message, receive every other node's) is reported as p50 / p90 / p99 / mean.
2. **Serving**: the one-process `--mesh dp=8` server and the same mesh over `--nodes` processes take the
   same `python -m jaxdp.bench` load; from each server's `/metrics` come the steps run and the time per step
   in the agreement (`jaxdp:step_agreement_seconds`, the exchange across nodes), next to the benchmark's
   throughput and TPOT.

Prints a table and writes JSON (`--output-file`). On a 2-core machine the processes share the cores, so
absolute step times are the CPU's; the ratio of agreement time to step time is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from jaxdp.engine.nodes.hosts import DistConfig, HostExchange, init_distributed, parse_dist_addr
from jaxdp.net import free_port
from jaxdp.parallel.agreement import Proposal

# ---- 1. the exchange alone ---------------------------------------------------------------------------


# the exchange's transport, and the other it is measured against (the runtime's key-value store, measured before in
# docs/multihost.md, is reachable only through a private JAX module: no longer measured)
TRANSPORTS = ("zmq", "gloo")


class GlooGather:
    """A jitted all-gather of one int32 row per node over a mesh of one CPU device per process (JAX's gloo
    CPU collectives): the other candidate transport for the exchange, measured here. A message travels as its
    length and its bytes in a fixed-width row."""

    def __init__(self, nnodes: int, width_bytes: int = 8192):
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        first: dict = {}
        for d in sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id)):
            first.setdefault(d.process_index, d)
        mesh = Mesh(np.array([first[p] for p in sorted(first)]), ("node",))
        self.device, self.shape = first[jax.process_index()], (nnodes, 1 + width_bytes // 4)
        self.sharding = NamedSharding(mesh, P("node"))
        gather = jax.shard_map(lambda x: jax.lax.all_gather(x, "node", tiled=True), mesh=mesh, in_specs=P("node"),
                               out_specs=P(), check_vma=False)
        self._gather = jax.jit(gather).lower(jax.ShapeDtypeStruct(self.shape, np.int32, sharding=self.sharding)
                                             ).compile()

    def __call__(self, payload: bytes, timeout_s: float | None = None) -> list[bytes]:  # (no timeout of its own)
        import jax
        import numpy as np

        row = np.zeros((1, self.shape[1]), np.int32)
        row[0, 0] = len(payload)
        row.view(np.uint8)[0, 4:4 + len(payload)] = np.frombuffer(payload, np.uint8)
        mine = jax.make_array_from_single_device_arrays(self.shape, self.sharding, [jax.device_put(row, self.device)])
        rows = np.asarray(self._gather(mine).addressable_data(0))
        return [r.view(np.uint8)[4:4 + r[0]].tobytes() for r in rows]


def exchange_worker(nodes: int, node: int, addr: str, rounds: int, out: str, transport: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    init_distributed(DistConfig(nodes, node, addr, timeout_s=60, init_timeout_s=120))
    dp = 8
    gather = {"gloo": lambda: GlooGather(nodes), "zmq": lambda: None}[transport]()
    ex = HostExchange(nodes, node, dp, timeout_s=60, gather=gather, coordinator_host=parse_dist_addr(addr)[0])
    state = {"num_running_reqs": 4, "num_queue_reqs": 1, "num_reqs": 5, "num_tokens": 300, "num_used_tokens": 320,
             "token_usage": 0.6, "max_total_num_tokens": 512, "page_size": 16, "num_pages": 32, "free_pages": 12,
             "cached_pages": 2, "cache_hit_rate": 0.1, "retracted_reqs": 0}
    times = []
    for i in range(rounds + 50):
        proposals = [Proposal(0, False, False)] * dp
        for r in ex.local_ranks():
            proposals[r] = Proposal(4 + i % 3, i % 7 == 0, True)
        message = {"updates": [(f"req-{i}-{r}", [i % 500], [], 0, None, None) for r in ex.local_ranks()],
                   "states": {r: state for r in ex.local_ranks()}} if node else {"new": [], "abort": []}
        t0 = time.perf_counter()
        ex.exchange(proposals, message)
        if i >= 50:  # the first rounds warm the connections (and compile the collective)
            times.append(time.perf_counter() - t0)
    ex.barrier("bench-done", 60)
    if node == 0:
        Path(out).write_text(json.dumps(times))
        time.sleep(1.0)  # the coordinator lives in node 0: let the others leave the barrier first
    sys.stdout.flush()
    os._exit(0)


def bench_exchange(nodes: int, rounds: int, transport: str) -> dict:
    addr = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        procs = [subprocess.Popen([sys.executable, "-m", "jaxdp.bench.multihost", "--exchange-worker", str(k),
                                   "--nodes", str(nodes), "--addr", addr, "--rounds", str(rounds), "--out", out,
                                   "--transport", transport],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for k in range(nodes)]
        for p in procs:
            _, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"an exchange worker failed:\n{err.decode()[-2000:]}")
        times = json.loads(Path(out).read_text())
    q = statistics.quantiles(times, n=100)
    return {"nodes": nodes, "transport": transport, "rounds": len(times), "p50_us": q[49] * 1e6,
            "p90_us": q[89] * 1e6, "p99_us": q[98] * 1e6, "mean_us": statistics.fmean(times) * 1e6}


# ---- 2. serving ----------------------------------------------------------------------------------------


SERVE_ARGS = ["--mesh", "dp=8", "--chunked-prefill-size", "64", "--max-running-requests", "64", "--cuda-graph-bs",
              "1", "2", "4", "8", "--page-size", "16", "--max-total-tokens", "1024", "--decode-log-interval", "1000"]


def _start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxdp.serve", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait(url: str, procs: list[subprocess.Popen], log: Path, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a server exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server did not come up in {timeout} s")


def _metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def bench_serving(nodes: int, load: list[str], workdir: Path) -> dict:
    port = free_port()
    env = dict(os.environ)
    procs = []
    if nodes == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        procs.append(_start([*SERVE_ARGS, "--port", str(port)], workdir / "node0.log", env))
    else:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nodes}"
        addr = f"127.0.0.1:{free_port()}"
        for k in range(nodes):
            procs.append(_start([*SERVE_ARGS, "--port", str(port if k == 0 else free_port()), "--nnodes",
                                 str(nodes), "--node-rank", str(k), "--dist-init-addr", addr],
                                workdir / f"node{k}.log", env))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, procs, workdir / "node0.log")
        before = httpx.get(url + "/metrics", timeout=10).text
        out = workdir / f"bench-{nodes}.json"
        subprocess.run([sys.executable, "-m", "jaxdp.bench", "--base-url", url, *load, "--output-file", str(out),
                        "--disable-tqdm"], check=True, stdout=subprocess.DEVNULL)
        after = httpx.get(url + "/metrics", timeout=10).text
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    result = json.loads(out.read_text())["results"][0]
    d = {k: _metric(after, k) - _metric(before, k) for k in
         ("jaxdp:step_agreement_seconds_sum", "jaxdp:step_agreement_seconds_count", "jaxdp:step_host_seconds_sum",
          "jaxdp:step_device_wait_seconds_sum")}
    steps = d["jaxdp:step_agreement_seconds_count"] or 1
    return {"nodes": nodes, "steps": int(steps),
            "agreement_ms_per_step": d["jaxdp:step_agreement_seconds_sum"] / steps * 1e3,
            "host_ms_per_step": d["jaxdp:step_host_seconds_sum"] / steps * 1e3,
            "device_wait_ms_per_step": d["jaxdp:step_device_wait_seconds_sum"] / steps * 1e3,
            "wall_ms_per_step": result["duration_s"] / steps * 1e3,  # the benchmark's duration over the steps run
            "output_throughput": result.get("output_throughput"),
            "median_tpot_ms": (result.get("tpot_ms") or {}).get("median"),
            "completed": result.get("completed")}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.multihost", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2], help="processes the model world spans (each "
                    "divides 8); part 1 runs for each, part 2 for the first")
    ap.add_argument("--rounds", type=int, default=2000, help="exchanges in part 1")
    ap.add_argument("--transport", choices=TRANSPORTS, nargs="+", default=list(TRANSPORTS),
                    help="part 1: the all-gather under the exchange (ZeroMQ, the collective)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--skip-serving", action="store_true", help="part 1 only")
    ap.add_argument("--output-file", default=None, help="write the results as JSON")
    ap.add_argument("--exchange-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.exchange_worker is not None:
        exchange_worker(args.nodes[0], args.exchange_worker, args.addr, args.rounds, args.out, args.transport[0])
        return 0
    bad = [n for n in args.nodes if n < 2 or 8 % n]
    if bad:
        print(f"error: --nodes {bad[0]} must be 2, 4 or 8 (it divides the 8 CPU devices)", file=sys.stderr)
        return 2
    results: dict = {"machine": f"{os.cpu_count()} CPU cores, loopback", "exchange": []}
    print(f"{'nodes':>5} {'transport':>10} {'rounds':>6} {'p50 us':>7} {'p90 us':>7} {'p99 us':>7} {'mean us':>7}")
    for nodes in args.nodes:
        for transport in args.transport:
            e = bench_exchange(nodes, args.rounds, transport)
            results["exchange"].append(e)
            print(f"{nodes:>5} {transport:>10} {e['rounds']:>6} {e['p50_us']:>7.0f} {e['p90_us']:>7.0f} "
                  f"{e['p99_us']:>7.0f} {e['mean_us']:>7.0f}", flush=True)
    if not args.skip_serving:
        load = ["--dataset-name", "random", "--num-prompts", str(args.num_prompts), "--random-input-len",
                str(args.input_len), "--random-output-len", str(args.output_len), "--max-concurrency",
                str(args.max_concurrency)]
        results["load"] = load
        with tempfile.TemporaryDirectory() as tmp:
            results["serving"] = [bench_serving(n, load, Path(tmp)) for n in (1, args.nodes[0])]
        print(f"\n{'processes':>9} {'steps':>6} {'wall ms/step':>13} {'agreement ms/step':>18} {'host ms/step':>13} "
              f"{'device wait ms/step':>20} {'out tok/s':>10} {'TPOT ms':>8}")
        for r in results["serving"]:
            print(f"{r['nodes']:>9} {r['steps']:>6} {r['wall_ms_per_step']:>13.1f} {r['agreement_ms_per_step']:>18.3f} "
                  f"{r['host_ms_per_step']:>13.2f} {r['device_wait_ms_per_step']:>20.2f} "
                  f"{r['output_throughput'] or 0:>10.1f} {r['median_tpot_ms'] or 0:>8.1f}")
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
