"""`python -m jaxdp.bench.engine`: the engine offline, layouts side by side, at several concurrencies.

For each layout and each concurrency C, C requests (random prompts, fixed output length) are submitted at
once and run to completion through `Engine.step`. Reported per run: output tokens/s, mean step time,
host time per step and its share of the step, mean rows per rank and the padding ratio (rows computed by
attention / rows needed), idle ranks per step. Prints a table and writes JSON.

`--host-only` replaces the device step by a stand-in of the same interface that returns at once
(`jaxdp.testing.HostOnlyRunner`: no model, no device arrays), so `host_ms` is the loop's own cost per step: scheduling,
building the step's arrays, booking the tokens. `--plot` draws host_ms against the request count, with
`--baseline` (an earlier JSON) beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

from jaxdp.bench.cpu import thread_cpu_seconds
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.layout import LayoutError, ensure_host_devices, parse_mesh_spec
from jaxdp.testing import HostOnlyRunner

HOST_ONLY_CONCURRENCY = "8,16,32,64,128,256,512,1024,2048"


def run_one(engine, concurrency: int, input_len: int, output_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    V = engine.model_cfg.vocab_size
    prompts = [rng.integers(0, V, input_len).tolist() for _ in range(concurrency)]
    sp = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    engine.stats.records.clear()
    steps_before = engine.stats.steps
    engine.flush_cache()
    cpu0, t0 = thread_cpu_seconds(os.getpid()), time.perf_counter()
    reqs = engine.generate(prompts, sp)
    wall, cpu1 = time.perf_counter() - t0, thread_cpu_seconds(os.getpid())
    s = engine.stats.summary()
    out_tokens = sum(len(r.output_ids) for r in reqs)
    decode = [r for r in engine.stats.records if r.kind == "decode"]
    return {
        "concurrency": concurrency, "output_tokens": out_tokens, "wall_s": wall, "tokens_per_s": out_tokens / wall,
        "steps": engine.stats.steps - steps_before, "step_ms": s["step_ms"], "host_ms": s["host_ms"],
        "host_share": s["host_share"], "rows_per_rank": s["rows_per_rank"], "padding_ratio": s["padding_ratio"],
        "idle_ranks": s["idle_ranks"],
        "decode_step_ms": 1e3 * float(np.mean([r.step_s for r in decode])) if decode else 0.0,
        "decode_host_ms": 1e3 * float(np.mean([r.host_s for r in decode])) if decode else 0.0,
        "compiles_in_steps": engine.stats.compiles_in_steps,
        # the process's CPU per output token by kind of thread (the engine's loop is the main thread here)
        "threads_cpu_us_per_token": {k: 1e6 * (cpu1[k] - cpu0[k]) / max(1, out_tokens) for k in cpu1},
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="tiny")
    ap.add_argument("--meshes", default="dp=8;tp=8", help="layouts to compare, ';'-separated")
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-per-rank", type=int, default=64, help="prompt tokens per rank per step")
    ap.add_argument("--json", default="bench_engine.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host-only", action="store_true",
                    help="a stand-in device step that returns at once: the host's cost alone (defaults: dp=8, "
                         f"concurrency {HOST_ONLY_CONCURRENCY}, 64-token prompts, 128 output tokens)")
    ap.add_argument("--plot", help="write a plot of host ms per step against concurrency to this PNG")
    ap.add_argument("--baseline", help="an earlier JSON of this benchmark to draw beside this run (--plot)")
    ap.add_argument("--deterministic", choices=["off", "on", "both"], default="off",
                    help="engines with --enable-deterministic-inference: off, on, or both (each mesh without, "
                         "then with it: its cost in one run; docs/determinism.md)")
    ap.add_argument("--rounds-on-demand", action="store_true",
                    help="build the engine for the first mesh and the largest concurrency, print 'ready', then run "
                         "one round per line read from stdin, each printed as one JSON line (what "
                         "`python -m jaxdp.bench.versus` alternates with the server's rounds)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.host_only:
        defaults = {"meshes": "dp=8", "concurrency": HOST_ONLY_CONCURRENCY, "input_len": 64, "output_len": 128}
        for k, v in defaults.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    logging.basicConfig(level=logging.WARNING)
    meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    conc = [int(c) for c in args.concurrency.split(",")]
    try:
        ensure_host_devices(max(parse_mesh_spec(m).world for m in meshes))
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]
    for spec, deterministic in [(m, d) for m in meshes for d in modes]:
        dp = parse_mesh_spec(spec).dp
        per_rank = max(1, max(conc) // dp)
        buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= per_rank} | {per_rank})
        ctx = args.input_len + args.output_len
        pages = per_rank * -(-ctx // args.page_size) + 8
        cfg = EngineConfig(page_size=args.page_size, num_pages=pages, max_running_requests=per_rank * dp,
                           chunked_prefill_size=args.chunk_per_rank * dp, decode_buckets=buckets,
                           context_length=ctx + args.page_size, max_len_extend_rows=1 << 30, seed=args.seed)
        t0 = time.perf_counter()
        if args.host_only:  # a ready runner: the seed is the schedulers' (sampling) alone
            engine = Engine(HostOnlyRunner(args.model_path, spec, pages, args.page_size), spec, cfg)
        else:  # the engine builds the runner: the seed also draws a preset's random weights
            engine = Engine(args.model_path, spec, cfg, seed=args.seed, deterministic=deterministic)
        warm = time.perf_counter() - t0
        if args.rounds_on_demand:
            return rounds_on_demand(engine, max(conc), args)
        for c in conc:
            r = run_one(engine, c, args.input_len, args.output_len, args.seed) | {
                "mesh": spec, "warmup_s": warm, "deterministic": deterministic}
            results.append(r)
            name = f"{spec} det" if deterministic else spec
            print(f"{name:>10} C={c:<4} {r['tokens_per_s']:9.1f} tok/s  step {r['step_ms']:7.2f} ms  "
                  f"host {r['host_ms']:6.2f} ms ({100 * r['host_share']:4.1f}%)  rows/rank {r['rows_per_rank']:6.2f}  "
                  f"padding {r['padding_ratio']:5.2f}x  idle {r['idle_ranks']:.2f}  "
                  f"decode host {r['decode_host_ms']:6.2f} ms", flush=True)
        engine.shutdown()
    print()
    print(table(results))
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot, args.baseline)
        print(f"wrote {args.plot}")
    return 0


def rounds_on_demand(engine, concurrency: int, args) -> int:
    print("ready", flush=True)
    for _ in sys.stdin:
        r = run_one(engine, concurrency, args.input_len, args.output_len, args.seed)
        print(json.dumps(r), flush=True)
    engine.shutdown()
    return 0


def plot(results: list[dict], path: str, baseline: str | None = None) -> None:
    """Host ms per step against concurrency, all steps and decode steps, one line per mesh (the baseline's
    dashed)."""
    import matplotlib  # (the benchmarks' optional dependency: jaxdp[bench])

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = [("", "-", results)]
    if baseline:
        with open(baseline) as f:
            runs.insert(0, ("before ", "--", json.load(f)["results"]))
    for label, style, rs in runs:
        for mesh in dict.fromkeys(r["mesh"] for r in rs):
            for key, marker in (("host_ms", "o"), ("decode_host_ms", "s")):
                pts = sorted((r["concurrency"], r[key]) for r in rs if r["mesh"] == mesh and key in r)
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker=marker, label=f"{label}{mesh} {key}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests (all ranks)")
    ax.set_ylabel("host ms per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: list[dict]) -> str:
    head = ("| mesh | concurrency | tokens/s | step ms | decode step ms | host ms/step | decode host ms | host share | "
            "rows/rank | padding | idle ranks |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['mesh'] + ' deterministic' * bool(r.get('deterministic'))} | {r['concurrency']} | "
            f"{r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
            f"{r['decode_step_ms']:.2f} | {r['host_ms']:.2f} | {r.get('decode_host_ms', 0.0):.2f} | "
            f"{100 * r['host_share']:.1f}% | "
            f"{r['rows_per_rank']:.2f} | {r['padding_ratio']:.2f}x | {r['idle_ranks']:.2f} |" for r in results]
    return "\n".join([head, *rows])


if __name__ == "__main__":
    sys.exit(main())
