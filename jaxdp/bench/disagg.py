"""`python -m jaxdp.bench.disagg`: how fast a request's KV moves from a prefill server's pool to a decode
server's, through `jaxdp.disagg` (read from the prefill rank's pages, offered on JAX's transfer server,
fetched by another process, written at the decode rank's pages), for prompts of 1k and 8k tokens.

Two processes on this machine, each its own pool of the model's KV format (default: DeepSeek-V3's, 61
layers of 512 + 64 latent values in bf16, about 69 KiB a token; `--layers`, `--width`, `--dtype` for
another), page size 16 on the prefill side and 32 on the decode side (the hand-off maps one onto the
other). Prints a table of each phase's time and the transfer's GB/s; `--json` writes the rounds.

The prompt is "read" as a schedule: steps of `--prefill-chunk` tokens, one every `--step-ms` (the device busy,
the host free; no model runs). `--granularity` says how the KV travels, several side by side: `all` (the serving
path: every layer and chunk in one transfer after the last step), `layer` (one transfer per layer after the last
step: jaxdp's step is one compiled program over all layers, so every layer is ready at the step's end) or
`chunk` (each step's tokens, all layers, offered as that step ends and pulled while the next step runs). Each
round is timed from the prompt's last step to the KV written on the decode side (what a decode server waits for
after the prompt is read: with `chunk`, only the last step's KV is left to move, plus any backlog).

    python -m jaxdp.bench.disagg --tokens 1024 8192 --rounds 3 --json benchmarks/results/disagg_transfer.json
    python -m jaxdp.bench.disagg --dtype float32 --granularity all layer chunk --rounds 2

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
import functools
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

from jaxdp.bench.launch import stop, wait_healthy
from jaxdp.disagg.bootstrap import BootstrapClient, BootstrapServer, PrefillInfo, RoomBoard
from jaxdp.disagg.kv import KVFormat, read_request_kv, write_request_kv
from jaxdp.disagg.transfer import JaxTransport
from jaxdp.net import free_port


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


GRANULARITIES = ("all", "layer", "chunk")


def _piece(room: int, k: int) -> int:
    """The transfer id (and board room) of piece k of a room's KV: a layer, or a prompt step's chunks."""
    return room * 1024 + k


@jax.jit
def _by_layer(chunks: list[dict]) -> list[dict]:
    """A request's chunks ([layers, chunk_tokens, width] per entry) as one piece per layer ([1, tokens, width])."""
    joined = {name: jnp.concatenate([c[name] for c in chunks], axis=1) for name in chunks[0]}
    layers = max(x.shape[0] for x in joined.values())
    return [{name: x[i: i + 1] for name, x in joined.items() if i < x.shape[0]} for i in range(layers)]


@functools.partial(jax.jit, static_argnums=1)
def _by_chunk(layers: list[dict], chunk_tokens: int) -> list[dict]:
    """`_by_layer`'s pieces back as the chunks `write_request_kv` takes."""
    joined = {name: jnp.concatenate([p[name] for p in layers if name in p], axis=0) for name in layers[0]}
    tokens = next(iter(joined.values())).shape[1]
    return [{name: x[:, c: c + chunk_tokens] for name, x in joined.items()} for c in range(0, tokens, chunk_tokens)]


def _layer_specs(fmt: KVFormat, n_tokens: int, sharding) -> list[dict]:
    """What `_by_layer` sends, as the receiving side asks for it."""
    tokens = fmt.chunks(n_tokens) * fmt.chunk_tokens
    return [{name: jax.ShapeDtypeStruct((1, tokens, width), jnp.dtype(dtype), sharding=sharding)
             for name, layers, width, dtype in fmt.entries if i < layers}
            for i in range(max(e[1] for e in fmt.entries))]


def _parts(fmt: KVFormat, n_tokens: int, granularity: str, prefill_chunk: int) -> list[range]:
    """The transfer chunks each piece moves: every chunk at once, or those of each prompt step ("chunk")."""
    if granularity != "chunk":
        return [range(fmt.chunks(n_tokens))]
    per = prefill_chunk // fmt.chunk_tokens
    return [range(c, min(c + per, fmt.chunks(n_tokens))) for c in range(0, fmt.chunks(n_tokens), per)]


def _sender_pages(longest: int) -> list[int]:
    """The sender's pages of a request (page size 16): scattered in the pool, as a request's pages are."""
    return np.random.default_rng(0).permutation(-(-longest // 16) + 1).tolist()


def _check(cache: dict, args, n: int) -> None:
    """`--check`: the decode pool holds, token for token, the KV at the sender's pages (its pool rebuilt here)."""
    sent = np.asarray(_pool(args.layers, args.width, args.dtype, 16, max(args.tokens), seed=0)["moe"], np.float32)
    t = np.arange(n)
    want = sent[0][:, np.asarray(_sender_pages(max(args.tokens)))[t // 16], t % 16]
    got = np.asarray(cache["moe"], np.float32)[0][:, t // 32, t % 32]
    if not np.array_equal(want, got):
        raise SystemExit(f"disagg: the KV of {n} tokens arrived wrong ({int((want != got).sum())} values differ)")


def sender(args) -> None:
    """The prefill side: a pool holding the longest prompt; each round's prompt "read" in steps of
    `--prefill-chunk` tokens that end every `step_ms` (a device busy with the steps, the host free), and its KV
    read and offered at the granularity asked: all at once after the last step, one piece per layer after the last
    step, or each step's chunks as that step ends (while the device runs the next)."""
    longest = max(args.tokens)
    cache = _pool(args.layers, args.width, args.dtype, 16, longest, seed=0)
    fmt = KVFormat.of(cache, args.chunk_tokens)
    transport, board = JaxTransport(), RoomBoard()
    server = BootstrapServer(PrefillInfo("bench", fmt.to_json(), 1, transport.name, transport.address()), board,
                             "127.0.0.1", args.port)
    pages = _sender_pages(longest)
    print("ready", flush=True)
    for line in sys.stdin:  # "ROOM TOKENS GRANULARITY STEP_MS" per round, from the receiver
        room, n, granularity, step_ms = line.split()
        room, n, step_s = int(room), int(n), float(step_ms) / 1e3
        start = time.monotonic()  # (CLOCK_MONOTONIC: one clock for both processes of this machine)
        steps = -(-n // args.prefill_chunk)
        for k, part in enumerate(_parts(fmt, n, granularity, args.prefill_chunk)):
            step_end = start + (k + 1 if granularity == "chunk" else steps) * step_s  # the device's schedule
            time.sleep(max(0.0, step_end - time.monotonic()))
            t0 = time.monotonic()
            chunks = read_request_kv(cache, 0, pages, n, fmt, part)
            pieces = _by_layer(chunks) if granularity == "layer" else [chunks]
            jax.block_until_ready(pieces)
            t1 = time.monotonic()
            for i, piece in enumerate(pieces):
                transport.offer(_piece(room, k + i), piece, timeout_s=120)
            board.publish(_piece(room, k), {"status": "ready", "rank": 0, "n_tokens": n, "start": start,
                                            "step_end": step_end, "read_ms": (t1 - t0) * 1e3,
                                            "offer_ms": (time.monotonic() - t1) * 1e3})
    server.close()


def _ready(client: BootstrapClient, port: int, room: int) -> dict:
    while (outcome := client.room("127.0.0.1", port, room, wait_s=30))["status"] == "pending":
        pass
    if outcome["status"] != "ready":
        raise SystemExit(f"disagg: the sender failed: {outcome.get('error')}")
    return outcome


def receiver(args) -> list[dict]:
    """The decode side: for each round, granularity and prompt length, the KV pulled piece by piece as the sender
    announces it and written into a pool of page size 32; timed from the prompt's last step to the last write."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxdp.bench.disagg", "--role", "sender", "--port", str(port),
                             "--layers", str(args.layers), "--width", str(args.width), "--dtype", args.dtype,
                             "--chunk-tokens", str(args.chunk_tokens), "--prefill-chunk", str(args.prefill_chunk),
                             "--tokens", *map(str, args.tokens)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit("disagg: the sender process did not start")
    client = BootstrapClient()
    info = client.info("127.0.0.1", port)
    fmt = KVFormat.from_json(info.kv)
    cache = _pool(args.layers, args.width, args.dtype, 32, max(args.tokens), seed=None)
    transport = JaxTransport()
    sharding = SingleDeviceSharding(jax.devices()[0])
    rows = []
    try:
        for r in range(args.rounds + 1):  # round 0 compiles the gather and scatter (no steps): not reported
            for g, granularity in enumerate(args.granularity):
                for n in args.tokens:
                    room = (r * len(GRANULARITIES) + g) * 100_000 + n
                    proc.stdin.write(f"{room} {n} {granularity} {args.step_ms if r else 0}\n")
                    proc.stdin.flush()
                    pages = list(range(-(-n // 32)))
                    if args.check:  # (a fresh pool: a part not written shows)
                        cache = _pool(args.layers, args.width, args.dtype, 32, max(args.tokens), seed=None)
                    parts = _parts(fmt, n, granularity, args.prefill_chunk)
                    read_ms = fetch_s = write_s = 0.0
                    for k, part in enumerate(parts):
                        outcome = _ready(client, port, _piece(room, k))
                        t1 = time.monotonic()
                        if granularity == "layer":
                            layers = [transport.fetch(info.address, _piece(room, i), spec, 120)
                                      for i, spec in enumerate(_layer_specs(fmt, n, sharding))]
                        else:
                            chunks = transport.fetch(info.address, _piece(room, k),
                                                     fmt.specs(n, sharding)[part.start: part.stop], 120)
                        t2 = time.monotonic()
                        if granularity == "layer":
                            chunks = _by_chunk(layers, fmt.chunk_tokens)
                        cache = write_request_kv(cache, 0, pages, n, fmt, chunks, first=part.start)
                        jax.block_until_ready(cache)
                        t3 = time.monotonic()
                        read_ms += outcome["read_ms"]
                        fetch_s, write_s = fetch_s + t2 - t1, write_s + t3 - t2
                    if args.check:
                        _check(cache, args, n)
                    if r == 0:
                        continue
                    nbytes, wait_s = fmt.nbytes(n), t3 - outcome["step_end"]
                    transfers = len(_layer_specs(fmt, n, sharding)) if granularity == "layer" else len(parts)
                    rows.append({"tokens": n, "granularity": granularity, "bytes": nbytes, "transfers": transfers,
                                 "prompt_steps": -(-n // args.prefill_chunk), "step_ms": args.step_ms,
                                 "read_ms": read_ms, "fetch_ms": fetch_s * 1e3, "write_ms": write_s * 1e3,
                                 "fetch_gb_s": nbytes / fetch_s / 1e9,
                                 "moved_gb_s": nbytes / (read_ms / 1e3 + fetch_s + write_s) / 1e9,
                                 "wait_ms": wait_s * 1e3, "wait_gb_s": nbytes / wait_s / 1e9,
                                 "total_ms": (t3 - outcome["start"]) * 1e3})
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.disagg", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens per transfer chunk (the serving path's)")
    ap.add_argument("--granularity", nargs="+", choices=GRANULARITIES, default=["all"],
                    help="all: one transfer after the prompt (the serving path); layer: one per layer; chunk: each "
                         "prompt step's KV as the step ends")
    ap.add_argument("--prefill-chunk", type=int, default=1024,
                    help="tokens per prompt step (SGLang's 8192 over 8 DP ranks)")
    ap.add_argument("--step-ms", type=float, default=1000.0, help="the time of one prompt step (the device busy)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="check every value that arrived (small sizes)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--servers", action="store_true", help="real servers: the hand-off's share of TTFT")
    ap.add_argument("--model-path", help="--servers: the model (default: the embedded default model)")
    ap.add_argument("--log-dir", default="bench-logs", help="--servers: the servers' logs")
    ap.add_argument("--role", choices=["receiver", "sender"], default="receiver", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.prefill_chunk % args.chunk_tokens or args.prefill_chunk <= 0:
        ap.error(f"--prefill-chunk {args.prefill_chunk} must be a positive multiple of --chunk-tokens "
                 f"{args.chunk_tokens}")
    if args.step_ms < 0 or max(args.tokens) >= 100_000 or args.layers >= 1024:
        ap.error("--step-ms must be at least 0, --tokens under 100,000 and --layers under 1,024")
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
    print(f"{'tokens':>7} {'granularity':>11} {'MiB':>7} {'pulls':>5} {'read ms':>8} {'fetch ms':>9} "
          f"{'write ms':>9} {'fetch GB/s':>10} {'moved GB/s':>10} {'wait ms':>8} {'wait GB/s':>9} {'x all':>6}")
    for n in tokens:
        all_wait = None
        for g in GRANULARITIES:
            mine = [r for r in rows if r["tokens"] == n and r["granularity"] == g]
            if not mine:
                continue
            med = {k: float(np.median([r[k] for r in mine])) for k in mine[0] if k != "granularity"}
            all_wait = med["wait_ms"] if g == "all" else all_wait
            ratio = f"{med['wait_ms'] / all_wait:>6.2f}" if all_wait else f"{'':>6}"
            print(f"{n:>7} {g:>11} {med['bytes'] / 2**20:>7.1f} {med['transfers']:>5.0f} {med['read_ms']:>8.1f} "
                  f"{med['fetch_ms']:>9.1f} {med['write_ms']:>9.1f} {med['fetch_gb_s']:>10.2f} "
                  f"{med['moved_gb_s']:>10.2f} {med['wait_ms']:>8.1f} {med['wait_gb_s']:>9.2f} {ratio}")
    print("(medians; wait: from the prompt's last step to the KV written on the decode side; moved GB/s: the KV "
          "over read + fetch + write)")


if __name__ == "__main__":
    main()
