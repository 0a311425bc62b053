"""Stage (b) of `python -m jaxdp.bench.gpu`: where a step's time goes, kernel by kernel, on the device it runs on.

    python -m jaxdp.bench.gpu_trace --jsonl OUT.jsonl --until EPOCH_S [--rehearse]

Builds DeepSeek-V3's first 5 layers (3 dense, 2 MoE of 256 experts) in block FP8 with bf16 activations on one
device as `python -m jaxdp.one_batch` does (`jaxdp.engine.setup.build_runners`, random weights), and for each step
shape (decode at batch 1, 32 and 256 over 64 cached tokens, prefill of 32 x 64 and 4 x 2,048 tokens) compiles the
step, times it (median, until its logits are ready) and runs it under `jax.profiler`. Each kernel the trace shows
(a GPU stream's kernels, named by their HLO instruction; on a CPU, XLA's thunks, nested time subtracted) is
charged its time per step, its bytes and FLOPs per call from the optimized HLO (`hlo_costs`: operands and result,
a slice counted as what it reads; dots' FLOPs; a custom call, such as a Pallas kernel, is charged its whole
operands and no FLOPs) and its share of the bandwidth measured on this machine (`jaxdp.planner.measured`). The
kernels are summed by model part (the HLO's op_name scopes, `jaxdp.bench.profile.op_parts`) beside the planner's
floor for that part, and the step beside its floor (bytes and FLOPs both priced) and XLA's cost analysis.

`--rehearse` (the CPU rehearsal) runs the same code at the tiny model's width, at small batches and prompts.
Each shape's result is one JSON line appended to `--jsonl` as soon as it is measured; no shape starts after
`--until` (seconds since the epoch), so what was measured survives a deadline.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import re
import tempfile
import time

import jax
import numpy as np

from jaxdp.batch import build_rank_batch, stack_ranks
from jaxdp.bench.profile import op_parts, step_pieces
from jaxdp.engine.setup import build_runners
from jaxdp.layout import parse_mesh_spec
from jaxdp.one_batch import weight_format
from jaxdp.ops.platform import keep_freed_host_memory
from jaxdp.parallel.step import StepShape
from jaxdp.planner.measured import machine, step_floor

# (name, decode?, sequences, tokens per sequence: new for a prefill, cached for a decode)
SHAPES = {
    "gpu": (("decode 1", True, 1, 64), ("decode 32", True, 32, 64), ("decode 256", True, 256, 64),
            ("prefill 32x64", False, 32, 64), ("prefill 4x2048", False, 4, 2048)),
    "rehearse": (("decode 2", True, 2, 16), ("prefill 2x16", False, 2, 16)),
}
PART_TERMS = {  # model part (op_name scope) -> the planner's floor term(s) it pays for
    "mla_projections": ("attention projections",), "mla_attention": ("KV cache",), "kv_write": (),
    "router": ("router",), "routed_experts": ("routed experts",), "shared_expert": ("shared expert",),
    "dense_ffn": ("dense layers",), "lm_head": ("LM head",), "embedding": (), "layer weight slices": (),
    "other": ("norms",),
}
CPU_TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"  # XLA:CPU's per-thunk trace events (set before JAX starts)

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s4": 0.5, "u4": 0.5, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


def _dtype_bytes(dtype: str) -> float:
    return 1 if dtype.startswith("f8") else _DTYPE_BYTES.get(dtype, 0)


def shapes_bytes(text: str) -> float:
    """Bytes of every array shape written in `text` (an HLO result or operand list)."""
    return sum(_dtype_bytes(d) * math.prod(int(x) for x in dims.split(",") if x) for d, dims in _SHAPE.findall(text))


def _dims(text: str) -> list[int]:
    m = _SHAPE.search(text)
    return [int(x) for x in m.group(2).split(",") if x] if m else []


def _split_operands(rest: str) -> tuple[str, str]:
    """An instruction's text after `opcode(`: (its operand list, its attributes)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def _parse(hlo_text: str) -> dict[str, list[tuple[str, str, str, str, str]]]:
    """Computation name -> its instructions (name, result text, opcode, operand text, attributes)."""
    comps: dict[str, list] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and " = " not in line.split("{")[0]:
                current = comps.setdefault(m.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            operands, attrs = _split_operands(m.group(4))
            current.append((m.group(1), m.group(2), m.group(3), operands, attrs))
    return comps


def _operand_results(operands: str, results: dict[str, str]) -> list[str]:
    """The result shape text of each operand (HLO names them, `%x`, or writes their shapes inline)."""
    named = re.findall(r"%([\w.\-]+)", operands)
    return [results.get(n, "") for n in named] if named else [operands]


def _dot_flops(result: str, operands: str, attrs: str, results: dict[str, str]) -> float:
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
    lhs = _dims(_operand_results(operands, results)[0])
    contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m and lhs else 0
    return 2.0 * math.prod(_dims(result)) * contracted


def _fusion_cost(comp: list, comps: dict, results: dict[str, str]) -> tuple[float, float]:
    """Bytes a fused computation reads from its parameters (a parameter only sliced or gathered: what the slices
    read) plus FLOPs of its dots, nested fusions included."""
    params = {name: (result, int(re.match(r"\s*(\d+)", operands).group(1)) if operands.strip() else 0)
              for name, result, op, operands, _ in comp if op == "parameter"}
    users: dict[str, list] = collections.defaultdict(list)
    flops = 0.0
    for _, result, op, operands, attrs in comp:
        for i, used in enumerate(re.findall(r"%([\w.\-]+)", operands)):
            users[used].append((op, i, result))
        if op in ("dot", "convolution"):
            flops += _dot_flops(result, operands, attrs, results)
        called = re.search(r"calls=%?([\w.\-]+)", attrs)
        if op == "fusion" and called and called.group(1) in comps:
            flops += _fusion_cost(comps[called.group(1)], comps, results)[1]
    read = 0.0
    for name, (result, _) in params.items():
        uses = users.get(name, [])
        if uses and all(op in ("dynamic-slice", "slice", "gather") and i == 0 for op, i, _ in uses):
            read += sum(shapes_bytes(r) for _, _, r in uses)
        elif uses and all(op == "dynamic-update-slice" and i == 0 for op, i, _ in uses):
            read += 0.0  # updated in place: the update is counted as its own operand
        else:
            read += shapes_bytes(result)
    return read, flops


def hlo_costs(hlo_text: str) -> dict[str, dict[str, float]]:
    """HLO instruction name -> {"bytes", "flops", "custom"} of one execution, from the optimized HLO's text:
    its result plus what it reads of its operands (a fusion's parameter that is only sliced or gathered counts
    as the slices), dots' FLOPs (2 x result x contracted size); a custom call (a Pallas kernel, a native one)
    its whole operands and result, no FLOPs (`custom`: 1)."""
    comps = _parse(hlo_text)
    results = {name: result for comp in comps.values() for name, result, *_ in comp}
    out = {}
    for comp in comps.values():
        for name, result, op, operands, attrs in comp:
            if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
                continue
            cost = {"bytes": shapes_bytes(result), "flops": 0.0, "custom": 0.0}
            called = re.search(r"calls=%?([\w.\-]+)", attrs)
            if op == "fusion" and called and called.group(1) in comps:
                read, flops = _fusion_cost(comps[called.group(1)], comps, results)
                cost["bytes"] += read
                cost["flops"] = flops
            elif op in ("while", "conditional", "call"):
                cost["bytes"] = 0.0  # its body's instructions are charged themselves
            elif op in ("dot", "convolution"):
                cost["bytes"] += sum(map(shapes_bytes, _operand_results(operands, results)))
                cost["flops"] = _dot_flops(result, operands, attrs, results)
            elif op in ("dynamic-slice", "slice", "gather"):
                cost["bytes"] *= 2
            else:
                cost["bytes"] += sum(map(shapes_bytes, _operand_results(operands, results)))
                cost["custom"] = float(op == "custom-call")
            out[name] = cost
    return out


def _stat(event, name: str):
    for key, value in event.stats:
        if key == name:
            return value
    return None


def kernel_times(xplane: str) -> dict[str, tuple[float, int]]:
    """HLO instruction -> (seconds, calls) over the whole trace: on a GPU the kernels of the device planes' streams
    (named by their `hlo_op` stat), on a CPU XLA's thunks on its threads (nested events' time subtracted)."""
    pd = jax.profiler.ProfileData.from_file(xplane)
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for plane in pd.planes:
        device = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if device and line.name.startswith("Stream"):
                for e in line.events:
                    op = _stat(e, "hlo_op") or e.name
                    total[op] += e.duration_ns
                    calls[op] += 1
            elif not device and line.name.startswith("tf_XLA"):
                stack: list[list] = []  # open events: [name, end_ns]
                for e in sorted(line.events, key=lambda e: (e.start_ns, -e.duration_ns)):
                    while stack and stack[-1][1] <= e.start_ns:
                        stack.pop()
                    if stack:
                        total[stack[-1][0]] -= e.duration_ns
                    total[e.name] += e.duration_ns
                    calls[e.name] += 1
                    stack.append([e.name, e.start_ns + e.duration_ns])
    return {k: (v / 1e9, calls[k]) for k, v in total.items()}


def measure_shape(runner, label: str, decode: bool, seqs: int, tokens: int, reps: int, mach) -> dict:
    """One step shape: its median time, its kernels (time, calls, bytes, FLOPs per step, share of bandwidth),
    its parts against their floors and the step against its floor."""
    S = runner.page_size
    pages = -(-(tokens + 1) // S)
    shape = StepShape(True, seqs, seqs, pages) if decode else StepShape(False, seqs * tokens, seqs, pages)
    pieces = step_pieces(runner.cfg, shape, tokens)
    batch = stack_ranks([build_rank_batch(pieces, num_rows=shape.num_rows, num_seqs=shape.num_seqs,
                                          all_logits=False, pages_per_seq=pages, page_size=S,
                                          num_pages=runner.num_pages)])
    t0 = time.perf_counter()
    compiled = runner.executable(shape)
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(runner.run(shape, batch)[0])
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.run(shape, batch)[0])
        walls.append(time.perf_counter() - t0)
    step_s = float(np.median(walls))
    hlo = compiled.as_text()
    costs, parts = hlo_costs(hlo), op_parts(hlo)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(runner.run(shape, batch)[0])
        found = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))
        times = kernel_times(found[-1]) if found else {}
    bw, peak = mach.read_bytes_per_s, mach.bf16_flops_per_s
    kernels = []
    for name, (seconds, n) in times.items():
        if name not in costs:
            continue  # the runtime's own events (a GPU's memcpy, a CPU's executable wrapper)
        c, per_step = costs[name], n / reps
        t = seconds / reps
        kernels.append(dict(kernel=name, part=parts.get(name, "other"), ms=t * 1e3, calls=per_step,
                            bytes=c["bytes"] * per_step, flops=c["flops"] * per_step, custom=bool(c["custom"]),
                            bw_share=c["bytes"] * per_step / max(t, 1e-12) / bw))
    kernels.sort(key=lambda k: -k["ms"])
    rows = [1] * seqs if decode else [tokens] * seqs
    floor = step_floor(runner.cfg, rows, tokens if decode else 0, "bfloat16", mach, expert_dtype=weight_format(runner))
    by_part = collections.defaultdict(float)
    for k in kernels:
        by_part[k["part"]] += k["ms"]
    part_rows = [dict(part=p, ms=by_part.get(p, 0.0),
                      floor_ms=sum(floor.term(t).ms for t in PART_TERMS.get(p, ())),
                      floor_bytes=sum(floor.term(t).hbm_bytes for t in PART_TERMS.get(p, ())),
                      floor_flops=sum(floor.term(t).flops for t in PART_TERMS.get(p, ())))
                 for p in sorted(set(by_part) | {p for p, ts in PART_TERMS.items() if ts}, key=lambda p: -by_part[p])]
    xla_cost = compiled.cost_analysis()
    xla_cost = xla_cost[0] if isinstance(xla_cost, list) else (xla_cost or {})
    return dict(shape=label, decode=decode, seqs=seqs, tokens=tokens, compile_s=compile_s, step_ms=step_s * 1e3,
                traced_ms=sum(k["ms"] for k in kernels), floor_ms=floor.ms,
                floor_bytes=sum(t.hbm_bytes for t in floor.terms), floor_flops=sum(t.flops for t in floor.terms),
                x_floor=step_s / max(floor.seconds, 1e-12),
                xla_bytes=float(xla_cost.get("bytes accessed", 0.0)), xla_flops=float(xla_cost.get("flops", 0.0)),
                peak_GBps=bw / 1e9, peak_bf16_TFLOPs=peak / 1e12, parts=part_rows, kernels=kernels)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.gpu_trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl", required=True, help="append one JSON line per measured shape here")
    ap.add_argument("--until", type=float, required=True, help="start no shape after this time (epoch seconds)")
    ap.add_argument("--rehearse", action="store_true", help="the CPU rehearsal: the tiny width, small shapes")
    ap.add_argument("--reps", type=int, default=5, help="timed and traced steps per shape")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shapes = SHAPES["rehearse" if args.rehearse else "gpu"]
    keep_freed_host_memory()
    mach = machine()
    S = 16 if args.rehearse else 64
    pages = max(seqs * -(-(tokens + 1) // S) for _, _, seqs, tokens in shapes) + 1
    layout = parse_mesh_spec("dp=1")
    t0 = time.perf_counter()
    runner = build_runners("deepseek-v3", layout, [layout.make_mesh(jax.devices()[:1])], dtype="bfloat16",
                           quantization="fp8", num_layers=5, tiny_width=args.rehearse, num_pages=pages,
                           page_size=S)[0]
    with open(args.jsonl, "a") as f:
        f.write(json.dumps(dict(event="model", load_s=time.perf_counter() - t0, layers=runner.cfg.num_layers,
                                hidden=runner.cfg.hidden_size, experts=runner.cfg.n_routed_experts,
                                weights=weight_format(runner), machine=mach.to_dict())) + "\n")
    for label, decode, seqs, tokens in shapes:
        if time.time() >= args.until:
            print(f"trace: {label} skipped, the deadline has come", flush=True)
            break
        result = measure_shape(runner, label, decode, seqs, tokens, args.reps, mach)
        print(f"trace: {label}: step {result['step_ms']:.2f} ms = {result['x_floor']:.1f}x its floor "
              f"({result['floor_ms']:.2f} ms); {len(result['kernels'])} kernels, {result['traced_ms']:.2f} ms traced",
              flush=True)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(dict(event="trace", **result)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
