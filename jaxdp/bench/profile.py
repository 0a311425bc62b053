"""`python -m jaxdp.bench.profile`: where a step's milliseconds go, by operation, on one device.

    python -m jaxdp.bench.profile [--model-path DIR] [--batches 1,8,32,256] [--extend-rows 256] [--dtype float32]
                                  [--mixed-decoders 32]

Builds the model as the server does (`jaxdp.engine.setup.build_runners`, default: the issue-26 checkpoint of
`jaxdp.bench.peer_model`, generated once under the cache), compiles decode steps at each batch size (rows with
`--context` tokens cached) and one extend step (with `--mixed-decoders`, carrying that many one-token sequences with
`--context` cached, as a mixed chunk or a DP step's relabeled decoders do), and runs each under `jax.profiler` with
XLA:CPU's per-thunk trace events (`--xla_cpu_enable_xprof_traceme`). Each executed thunk (a fusion, a dot, a copy)
is charged its own time (nested events subtracted) to the part of the model its HLO's `op_name` names: the model's
named scopes (embedding, mla_projections, kv_write, mla_attention, dense_ffn, router, routed_experts, shared_expert,
lm_head); "layer weight slices" are the scan's copies of one layer's weights out of the stacked arrays, "other" the
rest (residual adds, norms, the scan's bookkeeping, ops XLA left without an op_name). XLA runs thunks on two threads
side by side, so each part is given its share of the threads' time, scaled to the step's wall time. "step" is the
wall time of `StepRunner.run` with the logits read back (median), "host" the time to build the step's arrays,
"sampling" the engine's sampler on the logits (it runs after the step). Prints a table (ms per step) with the
roofline's floor, writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.bench.peer_model import ensure_checkpoint
from jaxdp.engine.setup import build_runners
from jaxdp.engine.step.sampling import sample_tokens
from jaxdp.layout import parse_mesh_spec
from jaxdp.ops.platform import keep_freed_host_memory
from jaxdp.parallel.step import StepShape
from jaxdp.planner.measured import machine, step_floor

SCOPES = ("routed_experts", "shared_expert", "router", "dense_ffn", "mla_projections", "kv_write", "mla_attention",
          "lm_head", "embedding")
PARTS = (*SCOPES, "layer weight slices", "other")
TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"


def timings(fn, *args, reps: int = 5) -> list[float]:
    """Seconds of `reps` calls of `fn(*args)` (run once before), each waited for."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def timed(fn, *args, reps: int = 5) -> float:
    """Median seconds of `fn(*args)` (run once before)."""
    return float(np.median(timings(fn, *args, reps=reps)))


def step_pieces(cfg, shape: StepShape, context: int, decoders: int = 0) -> list[Piece]:
    """Decode rows with `context` tokens cached, or extend sequences of `context` tokens followed by `decoders`
    one-token sequences with `context` tokens cached (a mixed chunk's decoders, or another rank's decoders
    relabeled as one-token extends), on pages 0, 1, ..."""
    B, N = shape.num_seqs, shape.pages_per_seq
    rng = np.random.default_rng(0)
    n = B if shape.absorbed else (shape.num_rows - decoders) // context
    one = [True] * B if shape.absorbed else [False] * n + [True] * decoders
    return [Piece([int(rng.integers(2, cfg.vocab_size))] if o else rng.integers(2, cfg.vocab_size, context).tolist(),
                  context if o else 0, list(range(b * N, (b + 1) * N))) for b, o in enumerate(one)]


def op_parts(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the part of the model it belongs to (from its op_name)."""
    out = {m.group(1): "other" for m in re.finditer(r"%([\w.\-]+) = ", hlo_text)}  # some carry no op_name
    for m in re.finditer(r"%([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text):
        name, op = m.group(1), m.group(2)
        part = next((s for s in SCOPES if f"/{s}/" in op or op.endswith(f"/{s}")), None)
        if part is None:  # the scan's slice of one layer out of the stacked weights (closed_call: its body)
            sliced = "dynamic_index_in_dim" in op or op.endswith(("/body/dynamic_slice", "/body/closed_call"))
            part = "layer weight slices" if sliced else "other"
        out[name] = part
    return out


def exclusive_ms(xplane: str, steps: int) -> dict[str, float]:
    """Exclusive milliseconds per step of every event on XLA's threads (time inside nested events subtracted)."""
    pd = jax.profiler.ProfileData.from_file(xplane)
    total: collections.Counter = collections.Counter()
    for plane in pd.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            stack: list[list] = []  # open events: [name, end_ns]

            def close_until(t, stack=stack):
                while stack and stack[-1][1] <= t:
                    stack.pop()

            for e in sorted(line.events, key=lambda e: (e.start_ns, -e.duration_ns)):
                close_until(e.start_ns)
                if stack:
                    total[stack[-1][0]] -= e.duration_ns
                total[e.name] += e.duration_ns
                stack.append([e.name, e.start_ns + e.duration_ns])
    return {k: v / 1e6 / steps for k, v in total.items()}


def profile_step(runner, shape: StepShape, context: int, reps: int, top: int = 0,
                 decoders: int = 0) -> dict[str, float]:
    """Milliseconds by part of one step of `shape` (see the module's docstring)."""
    S = runner.page_size
    pieces = step_pieces(runner.cfg, shape, context, decoders)

    def build():
        return stack_ranks([build_rank_batch(pieces, num_rows=shape.num_rows, num_seqs=shape.num_seqs,
                                             all_logits=False, pages_per_seq=shape.pages_per_seq, page_size=S,
                                             num_pages=runner.num_pages)])

    t0 = time.perf_counter()
    for _ in range(reps):
        stacked = build()
    build_ms = (time.perf_counter() - t0) / reps * 1e3
    runner.compile(shape)
    logits, _ = runner.run(shape, stacked)
    np.asarray(logits)
    walls = []
    for _ in range(reps):
        batch = build()  # (timed apart above: "host: build the step's arrays")
        t0 = time.perf_counter()
        logits, _ = runner.run(shape, batch)
        np.asarray(logits)
        walls.append(time.perf_counter() - t0)
    parts = op_parts(runner._compiled[shape].as_text())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                np.asarray(runner.run(shape, stacked)[0])
        xplane = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
        events = exclusive_ms(xplane, reps)
    thread_ms = dict.fromkeys(PARTS, 0.0)
    for name, t in events.items():
        if name in parts:
            thread_ms[parts[name]] += t
    if top:
        for name, t in sorted(events.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {t:8.2f} ms  {name} ({parts.get(name, 'runtime')})")
    # XLA's threads run thunks side by side: each part gets its share of their time, scaled to the step's
    ms = {"step": float(np.median(walls)) * 1e3, "XLA thread time": sum(thread_ms.values())}
    scale = ms["step"] / max(ms["XLA thread time"], 1e-9)
    ms |= {p: t * scale for p, t in thread_ms.items()}
    ms["host: build the step's arrays"] = build_ms

    B = shape.num_seqs
    samp = (np.ones((1, B), np.float32), np.ones((1, B), np.float32), np.full((1, B), -1, np.int32),
            np.zeros((1, B), np.float32), np.zeros((1, B, 2), np.uint32))
    ms["sampling (engine, after the step)"] = timed(sample_tokens, logits, *samp, reps=reps) * 1e3
    return ms


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", help="checkpoint directory (default: the issue-26 checkpoint, built once)")
    ap.add_argument("--batches", default="1,8,32,256", help="decode batch sizes")
    ap.add_argument("--extend-rows", type=int, default=256, help="rows of the extend step (prompts of --context)")
    ap.add_argument("--context", type=int, default=64, help="tokens cached per decode row / per extend prompt")
    ap.add_argument("--pages", type=int, default=None, help="page-table width (default: what --context needs; a "
                    "server's is its page bucket, e.g. 16 for `jaxdp.bench.peer`'s 256-token context)")
    ap.add_argument("--extend-seqs", type=int, default=None, help="sequences the extend step is padded to (default: "
                    "its prompts; a server's extend bucket pads to min(rows, requests per rank), e.g. 64)")
    ap.add_argument("--mixed-decoders", type=int, default=0, help="one-token sequences with --context cached "
                    "added to the extend step (a mixed chunk's decoders; under DP, other ranks' decoders)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--moe-runner-backend", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=0, help="also list the N thunks that take longest in each step")
    ap.add_argument("--json", default="benchmarks/results/profile.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if TRACE_FLAG not in os.environ.get("XLA_FLAGS", ""):  # read when the backend starts, below
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TRACE_FLAG}".strip()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    keep_freed_host_memory()
    path = args.model_path or str(ensure_checkpoint())
    layout = parse_mesh_spec("dp=1")
    batches = [int(b) for b in args.batches.split(",") if b]
    S = 16
    N = args.pages or -(-(args.context + 1) // S)
    num_pages = max(max(batches), max(1, args.extend_rows // args.context) + args.mixed_decoders) * N + 1
    runner = build_runners(path, layout, [layout.make_mesh(jax.devices()[:1])], dtype=args.dtype,
                           num_pages=num_pages, page_size=S, moe_backend=args.moe_runner_backend)[0]
    mach = machine()
    shapes = [(f"decode {b}", StepShape(True, b, b, N), [1] * b) for b in batches]
    if args.extend_rows:
        n, d = max(1, args.extend_rows // args.context), args.mixed_decoders
        B = max(n + d, args.extend_seqs or n + d)
        shapes.append((f"extend {n}x{args.context}" + (f" + {d} decoders" if d else "")
                       + (f" ({B} seqs)" if B > n + d else ""),
                       StepShape(False, n * args.context + d, B, N), [args.context] * n + [1] * d))
    cols = {}
    for name, shape, row_tokens in shapes:
        load = os.getloadavg()[0]
        d = 0 if shape.absorbed else args.mixed_decoders
        ms = profile_step(runner, shape, args.context, args.reps, args.top, d)
        cached = args.context if shape.absorbed else 0  # the extend step's prompts start from nothing cached
        floor = step_floor(runner.cfg, row_tokens[: len(row_tokens) - d], cached, args.dtype, mach).seconds
        if d:  # (a mixed step's floor: at least its prompts' alone and its decoders' alone)
            floor = max(floor, step_floor(runner.cfg, [1] * d, args.context, args.dtype, mach).seconds)
        ms["floor (roofline)"] = floor * 1e3
        ms["x the floor"] = ms["step"] / ms["floor (roofline)"]
        ms["load average"] = load
        cols[name] = ms
        print(f"{name}: step {ms['step']:.1f} ms, {ms['x the floor']:.1f}x the floor (load {load:.2f})", flush=True)
    rows = [*PARTS, "step", "XLA thread time", "host: build the step's arrays",
            "sampling (engine, after the step)", "floor (roofline)", "x the floor", "load average"]
    print(f"\n| ms ({args.dtype}, {args.moe_runner_backend or 'default'} experts) | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in rows:
        print(f"| {r} | " + " | ".join(f"{c.get(r, 0.0):.2f}" for c in cols.values()) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": path, "dtype": args.dtype, "context": args.context,
                                               "moe_runner_backend": args.moe_runner_backend,
                                               "machine": mach.to_dict(), "steps": cols}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
