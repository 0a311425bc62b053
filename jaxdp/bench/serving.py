"""`python -m jaxdp.bench`: a serving benchmark client in the manner of SGLang's bench_serving.

It streams requests to a running server (jaxdp or SGLang through the native `/generate`, or any OpenAI
`/v1/completions`) and reports request and token throughput, TTFT, ITL, TPOT and end-to-end latency (mean,
median, p99). Prompts are random token ids (no tokenizer needed) or the first human turn of a ShareGPT-format
JSON file read through grain. Load is closed loop (`--max-concurrency`), open loop (`--request-rate`, Poisson)
or both; `--sweep-concurrency 1,8,64` runs one point per concurrency. `--routed-dp-rank` pins requests to
ranks: `none`, `0`, `0,1,2,3` (cycle) or `skewed:40,8,8,8` (counts proportional to the weights of ranks 0..).

    python -m jaxdp.bench --base-url http://127.0.0.1:30000 --num-prompts 64 --sweep-concurrency 1,8,64 \\
        --random-input-len 128 --random-output-len 32 --output-file out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import httpx
import numpy as np


class BenchError(Exception):
    """A user-facing failure: printed as one `error: ...` line, exit status 2."""


@dataclass
class Request:
    prompt: str | list[int]
    input_len: int
    output_len: int
    rank: int | None = None


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    dp_rank: int | None = None
    token_at: list[float] = field(default_factory=list)  # perf_counter() when each token arrived (the experiments)


def random_requests(args, rng: np.random.Generator) -> list[Request]:
    def lengths(full: int) -> np.ndarray:
        low = max(1, int(full * args.random_range_ratio))
        return rng.integers(low, full + 1, size=args.num_prompts)

    ins, outs = lengths(args.random_input_len), lengths(args.random_output_len)
    return [Request(rng.integers(1, args.random_vocab_size, size=int(i)).tolist(), int(i), int(o))
            for i, o in zip(ins, outs, strict=True)]


def sharegpt_requests(args, seed: int) -> list[Request]:
    import grain

    if not args.dataset_path:
        raise BenchError("--dataset-name sharegpt needs --dataset-path FILE.json")
    try:
        with open(args.dataset_path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read the ShareGPT file {args.dataset_path}: {e}") from None
    if not isinstance(data, list):
        raise BenchError(f"{args.dataset_path} is not a ShareGPT JSON list of {{conversations: [...]}}")

    def first_turns(entry) -> tuple[str, str] | None:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            return None
        humans = [i for i, t in enumerate(turns) if isinstance(t, dict) and t.get("from") in ("human", "user")]
        if not humans or not str(turns[humans[0]].get("value", "")).strip():
            return None
        reply = turns[humans[0] + 1] if humans[0] + 1 < len(turns) else {}
        return str(turns[humans[0]]["value"]), str(reply.get("value", "") if isinstance(reply, dict) else "")

    def to_request(pair: tuple[str, str]) -> Request:
        prompt, reply = pair
        # no tokenizer here: ~4 characters a token until the server reports the true prompt length
        out = args.sharegpt_output_len or max(4, len(reply) // 4)
        return Request(prompt, max(1, len(prompt) // 4), out)

    ds = grain.MapDataset.source(data).map(first_turns).filter(lambda p: p is not None).shuffle(seed=seed)
    reqs = [to_request(p) for p in ds][:args.num_prompts]
    if not reqs:
        raise BenchError(f"{args.dataset_path} holds no conversation with a human turn")
    return reqs


def rank_pattern(spec: str, n: int) -> list[int | None]:
    """The rank of each of `n` requests: none, a cycle (`0,1,2`) or `skewed:w0,w1,...` (proportional)."""
    spec = spec.strip()
    if spec.lower() in ("", "none"):
        return [None] * n
    try:
        if spec.startswith("skewed:"):
            weights = [float(w) for w in spec[len("skewed:"):].split(",")]
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError
            share = np.array(weights) / sum(weights) * n
            counts = np.floor(share).astype(int)
            for i in np.argsort(-(share - counts), kind="stable")[: n - counts.sum()]:
                counts[i] += 1
            # interleave: rank r's k-th request sits at (k + 0.5) / counts[r] of the way through
            slots = sorted(((k + 0.5) / c, r) for r, c in enumerate(counts) for k in range(c))
            return [r for _, r in slots]
        ranks = [int(r) for r in spec.split(",")]
        if any(r < 0 for r in ranks):
            raise ValueError
    except ValueError:
        raise BenchError(f"--routed-dp-rank {spec!r}: expected none, a rank list like 0,1,2,3, "
                         "or skewed:40,8,8,8") from None
    return [ranks[i % len(ranks)] for i in range(n)]


def request_body(args, req: Request) -> tuple[str, dict]:
    if args.backend == "openai":
        body = {"model": args.model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
                "ignore_eos": not args.disable_ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}
        path = "/v1/completions"
    else:
        key = "input_ids" if isinstance(req.prompt, list) else "text"
        body = {key: req.prompt, "stream": True,
                "sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0,
                                    "ignore_eos": not args.disable_ignore_eos}}
        path = "/generate"
    if req.rank is not None:
        body["routed_dp_rank"] = req.rank
    return path, body


def session(args) -> aiohttp.ClientSession:
    """The client's HTTP session (`async with`): no limit on connections, the API key, `--timeout` per request.

    aiohttp, as SGLang's bench_serving and vLLM's benchmark client use: it reads 256 streams of 64 events in a
    tenth of httpx's time and CPU (`python -m jaxdp.bench.client_cost`), and until a request is on the wire the
    server can only wait, so a slow client shows up as a slow server."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=args.timeout), read_bufsize=1 << 20)


async def send(client: aiohttp.ClientSession, args, req: Request, out: Outcome | None = None) -> Outcome:
    """Stream one request over `client` (a `session`). `out`, when given, is filled as tokens arrive (a caller
    that cancels the task keeps what arrived so far)."""
    path, body = request_body(args, req)
    out = out if out is not None else Outcome()
    out.prompt_tokens = req.input_len
    start = last = time.perf_counter()
    tokens = 0
    try:
        async with client.post(args.base_url + path, json=body) as r:
            if r.status != 200:
                out.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:300]}"
                return out
            async for raw in r.content:  # one SSE line at a time
                line = raw.decode()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    return out
                now = time.perf_counter()
                if args.backend == "openai":
                    if chunk.get("usage"):
                        out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        tokens = max(tokens, chunk["usage"]["completion_tokens"])
                    new = sum(len(c.get("token_ids") or []) or int(bool(c.get("text"))) for c in chunk["choices"])
                    seen = tokens + new if new else tokens
                else:
                    meta = chunk.get("meta_info", {})
                    out.prompt_tokens = meta.get("prompt_tokens", out.prompt_tokens)
                    out.dp_rank = meta.get("dp_rank", out.dp_rank)
                    seen = meta.get("completion_tokens", len(chunk.get("output_ids") or []))
                if seen > tokens:
                    if tokens == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    out.token_at.extend([now] * (seen - tokens))
                    last, tokens = now, seen
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.e2e = time.perf_counter() - start
    out.output_tokens = tokens
    out.ok = tokens > 0
    if not out.ok:
        out.error = "the stream ended without a token"
    return out


async def run_point(args, reqs: list[Request], concurrency: int | None, rate: float) -> dict:
    from tqdm.auto import tqdm

    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = np.random.default_rng(args.seed)
    bar = tqdm(total=len(reqs), disable=args.disable_tqdm, desc=f"concurrency={concurrency or 'inf'}")

    async with session(args) as client:
        async def one(req: Request) -> Outcome:
            if gate is None:
                res = await send(client, args, req)
            else:
                async with gate:
                    res = await send(client, args, req)
            bar.update(1)
            return res

        for _ in range(args.warmup_requests):
            warm = await send(client, args, Request(reqs[0].prompt, reqs[0].input_len, min(4, reqs[0].output_len)))
            if not warm.ok:
                raise BenchError(f"the warm-up request failed: {warm.error}")
        t0 = time.perf_counter()
        tasks = []
        for req in reqs:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return summarize(outcomes, duration, concurrency, rate)


def stats(values: list[float], scale: float = 1000.0) -> dict:
    a = np.asarray(values or [0.0]) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(outcomes: list[Outcome], duration: float, concurrency: int | None, rate: float) -> dict:
    done = [o for o in outcomes if o.ok]
    inputs, outputs = sum(o.prompt_tokens for o in done), sum(o.output_tokens for o in done)
    ranks = dict(Counter(str(o.dp_rank) for o in done if o.dp_rank is not None))
    return {
        "max_concurrency": concurrency, "request_rate": rate if math.isfinite(rate) else "inf",
        "completed": len(done), "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5], "duration_s": duration,
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(done) / duration, "input_throughput": inputs / duration,
        "output_throughput": outputs / duration, "total_token_throughput": (inputs + outputs) / duration,
        "ttft_ms": stats([o.ttft for o in done]), "itl_ms": stats([t for o in done for t in o.itl]),
        "tpot_ms": stats([(o.e2e - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]),
        "e2e_latency_ms": stats([o.e2e for o in done]), "requests_per_dp_rank": ranks,
    }


def table(points: list[dict]) -> str:
    rows = [("Max concurrency", lambda p: p["max_concurrency"] or "inf"), ("Request rate", lambda p: p["request_rate"]),
            ("Successful requests", lambda p: p["completed"]), ("Failed requests", lambda p: p["failed"]),
            ("Duration (s)", lambda p: p["duration_s"]), ("Total input tokens", lambda p: p["total_input_tokens"]),
            ("Total output tokens", lambda p: p["total_output_tokens"]),
            ("Request throughput (req/s)", lambda p: p["request_throughput"]),
            ("Input token throughput (tok/s)", lambda p: p["input_throughput"]),
            ("Output token throughput (tok/s)", lambda p: p["output_throughput"])]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_latency_ms", "E2E")):
        for s in ("mean", "median", "p99"):
            rows.append((f"{s.capitalize()} {name} (ms)", lambda p, k=key, s=s: p[k][s]))
    rows.append(("Requests per dp_rank 0,1,..", lambda p: "/".join(
        str(p["requests_per_dp_rank"].get(str(r), 0)) for r in range(1 + max(map(int, p["requests_per_dp_rank"]),
                                                                              default=-1))) or "-"))
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)
    cells = [[name, *(fmt(get(p)) for p in points)] for name, get in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    rule = "-" * (sum(widths) + 3 * (len(widths) - 1))
    lines = ["=" * len(rule), "Serving Benchmark Result".center(len(rule)), "=" * len(rule)]
    for r in cells:
        lines.append(" | ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))]))
    lines.append(rule)
    return "\n".join(lines)


def plot(points: list[dict], path: str, title: str, unbounded: int) -> None:
    """Output throughput and median TPOT against max concurrency (no limit plots as `unbounded`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [p["max_concurrency"] or unbounded for p in points]
    fig, ax1 = plt.subplots(figsize=(7, 4.2), layout="tight")
    ax1.plot(conc, [p["output_throughput"] for p in points], "o-", color="tab:blue", label="output throughput")
    ax1.set_xlabel("max concurrency")
    ax1.set_ylabel("output throughput (tok/s)", color="tab:blue")
    ax1.set_xscale("log", base=2)
    ax2 = ax1.twinx()
    ax2.plot(conc, [p["tpot_ms"]["median"] for p in points], "s--", color="tab:red", label="median TPOT")
    ax2.set_ylabel("median TPOT (ms)", color="tab:red")
    ax1.set_xticks(conc, [str(c) for c in conc])
    ax1.grid(alpha=0.3)
    ax1.set_title(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(message)


def build_parser() -> argparse.ArgumentParser:
    """The client's flags (SGLang's bench_serving names); `parse_args` also checks their values."""
    p = Parser(prog="python -m jaxdp.bench", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=["jaxdp", "sglang", "openai"], default="jaxdp",
                   help="jaxdp/sglang: native /generate; openai: /v1/completions")
    p.add_argument("--model", help="model name for the openai backend (default: the first of /v1/models)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    p.add_argument("--dataset-path", help="ShareGPT-format JSON file")
    p.add_argument("--sharegpt-output-len", type=int, help="output tokens per ShareGPT request "
                   "(default: the reply's length / 4 characters)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths are uniform in [len * ratio, len]; 1.0 = fixed")
    p.add_argument("--random-vocab-size", type=int, default=512, help="random token ids are drawn below this")
    p.add_argument("--max-concurrency", type=int, help="closed loop: requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="open loop: Poisson arrivals per s")
    p.add_argument("--sweep-concurrency", help="comma-separated concurrencies, one run each (e.g. 1,8,64)")
    p.add_argument("--routed-dp-rank", default="none", help="none | 0 | 0,1,2,3 (cycle) | skewed:40,8,8,8")
    p.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", help="write every result as JSON")
    p.add_argument("--plot", help="PNG of output throughput and median TPOT vs concurrency")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags of `argv`, checked (BenchError in one sentence for a value out of range)."""
    args = build_parser().parse_args(argv)
    if bad := [n for n in ("num_prompts", "random_input_len", "random_output_len", "random_vocab_size",
                           "warmup_requests") if getattr(args, n) < (0 if n == "warmup_requests" else 1)]:
        raise BenchError(f"--{bad[0].replace('_', '-')} is out of range")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise BenchError("--random-range-ratio must be in [0, 1]")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise BenchError("--request-rate and --max-concurrency must be positive")
    try:
        args.sweep = [int(c) for c in args.sweep_concurrency.split(",")] if args.sweep_concurrency else None
    except ValueError:
        raise BenchError(f"--sweep-concurrency {args.sweep_concurrency!r}: expected integers like 1,8,64") from None
    if args.sweep is not None and any(c < 1 for c in args.sweep):
        raise BenchError("--sweep-concurrency values must be at least 1")
    args.base_url = args.base_url.rstrip("/")
    return args


def check_server(args) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(args.base_url + "/health", headers=headers, timeout=10)
        if r.status_code != 200:
            raise BenchError(f"{args.base_url}/health answered {r.status_code}")
        if args.backend == "openai" and not args.model:
            models = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=10).json()
            args.model = models["data"][0]["id"]
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {args.base_url}: {e}") from None
    except (ValueError, KeyError, IndexError):
        raise BenchError(f"{args.base_url}/v1/models did not list a model; pass --model") from None


def run(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    reqs = sharegpt_requests(args, args.seed) if args.dataset_name == "sharegpt" else random_requests(args, rng)
    for req, rank in zip(reqs, rank_pattern(args.routed_dp_rank, len(reqs)), strict=True):
        req.rank = rank
    check_server(args)
    points = []
    for conc in args.sweep or [args.max_concurrency]:
        point = asyncio.run(run_point(args, reqs, conc, args.request_rate))
        if point["completed"] == 0:
            raise BenchError(f"every request failed: {'; '.join(point['errors'])}")
        points.append(point)
    return points


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        points = run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(points))
    if args.output_file:
        config = {k: v for k, v in vars(args).items() if k not in ("sweep",)}
        config["request_rate"] = "inf" if not math.isfinite(args.request_rate) else args.request_rate
        with open(args.output_file, "w") as f:
            json.dump({"config": config, "results": points}, f, indent=2)
    if args.plot:
        title = f"{args.backend} {args.dataset_name}: in {args.random_input_len}, out {args.random_output_len}"
        plot(points, args.plot, title, args.num_prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
