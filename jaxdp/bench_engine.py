"""`python -m jaxdp.bench_engine`: the engine offline, layouts side by side, at several concurrencies.

For each layout and each concurrency C, C requests (random prompts, fixed output length) are submitted at
once and run to completion through `Engine.step`. Reported per run: output tokens/s, mean step time,
host time per step and its share of the step, mean rows per rank and the padding ratio (rows computed by
attention / rows needed), idle ranks per step. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np


def run_one(engine, concurrency: int, input_len: int, output_len: int, seed: int) -> dict:
    from jaxdp.engine import SamplingParams

    rng = np.random.default_rng(seed)
    V = engine.model_cfg.vocab_size
    prompts = [rng.integers(0, V, input_len).tolist() for _ in range(concurrency)]
    sp = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    engine.stats.records.clear()
    steps_before = engine.stats.steps
    engine.flush_cache()
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, sp)
    wall = time.perf_counter() - t0
    s = engine.stats.summary()
    out_tokens = sum(len(r.output_ids) for r in reqs)
    decode = [r for r in engine.stats.records if r.kind == "decode"]
    return {
        "concurrency": concurrency, "output_tokens": out_tokens, "wall_s": wall, "tokens_per_s": out_tokens / wall,
        "steps": engine.stats.steps - steps_before, "step_ms": s["step_ms"], "host_ms": s["host_ms"],
        "host_share": s["host_share"], "rows_per_rank": s["rows_per_rank"], "padding_ratio": s["padding_ratio"],
        "idle_ranks": s["idle_ranks"],
        "decode_step_ms": 1e3 * float(np.mean([r.step_s for r in decode])) if decode else 0.0,
        "compiles_in_steps": engine.stats.compiles_in_steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="tiny")
    ap.add_argument("--meshes", default="dp=8;tp=8", help="layouts to compare, ';'-separated")
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunk-per-rank", type=int, default=64, help="prompt tokens per rank per step")
    ap.add_argument("--json", default="bench_engine.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from jaxdp.layout import LayoutError, ensure_host_devices, parse_mesh_spec

    meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    conc = [int(c) for c in args.concurrency.split(",")]
    try:
        ensure_host_devices(max(parse_mesh_spec(m).world for m in meshes))
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxdp.engine import Engine, EngineConfig

    results = []
    for spec in meshes:
        dp = parse_mesh_spec(spec).dp
        per_rank = max(1, max(conc) // dp)
        buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= per_rank} | {per_rank})
        ctx = args.input_len + args.output_len
        pages = per_rank * -(-ctx // args.page_size) + 8
        cfg = EngineConfig(page_size=args.page_size, num_pages=pages, max_running_requests=per_rank * dp,
                           chunked_prefill_size=args.chunk_per_rank * dp, decode_buckets=buckets,
                           context_length=ctx + args.page_size, max_len_extend_rows=1 << 30)
        t0 = time.perf_counter()
        engine = Engine(args.model_path, spec, cfg, seed=args.seed)
        warm = time.perf_counter() - t0
        for c in conc:
            r = run_one(engine, c, args.input_len, args.output_len, args.seed) | {"mesh": spec, "warmup_s": warm}
            results.append(r)
            print(f"{spec:>10} C={c:<4} {r['tokens_per_s']:9.1f} tok/s  step {r['step_ms']:7.2f} ms  "
                  f"host {r['host_ms']:6.2f} ms ({100 * r['host_share']:4.1f}%)  rows/rank {r['rows_per_rank']:6.2f}  "
                  f"padding {r['padding_ratio']:5.2f}x  idle {r['idle_ranks']:.2f}", flush=True)
        engine.shutdown()
    print()
    print(table(results))
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.json}")
    return 0


def table(results: list[dict]) -> str:
    head = ("| mesh | concurrency | tokens/s | step ms | decode step ms | host ms/step | host share | rows/rank | "
            "padding | idle ranks |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['mesh']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
            f"{r['decode_step_ms']:.2f} | {r['host_ms']:.2f} | {100 * r['host_share']:.1f}% | "
            f"{r['rows_per_rank']:.2f} | {r['padding_ratio']:.2f}x | {r['idle_ranks']:.2f} |" for r in results]
    return "\n".join([head, *rows])


if __name__ == "__main__":
    sys.exit(main())
