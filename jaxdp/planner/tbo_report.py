"""Two-batch overlap on paper: which compute XLA:GPU's schedule puts inside each MoE collective of a micro-batch.

`python -m jaxdp.planner.tbo_report` compiles DeepSeek-V3 (block FP8, full width, few layers: `--layers`, the
first of them dense) under `dp=8,moe=ep` for 8 simulated H200s (the planner's deviceless XLA:GPU path,
`jaxdp.planner.xla_target`), a decode step of 256 rows a rank and a prompt step of 4,096 tokens a rank, each split
into two micro-batches (`jaxdp.parallel.tbo`) and, as the control, whole. In the scheduled HLO each collective of
the layers belongs to the micro-batch whose named scope (`tbo_mb0`, `tbo_mb1`, `jaxdp.model.decoder`) it carries;
for an asynchronous one (start .. done) the report lists the other micro-batch's compute scheduled between its
start and its done. The goal, per collective: the other micro-batch computes inside it (none synchronous, none
with nothing of the other inside). A step without the split has no micro-batch collectives and fails the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

import jax.numpy as jnp

from jaxdp.layout import parse_mesh_spec
from jaxdp.model.loader import preset_config
from jaxdp.ops.attention import decode_kernels
from jaxdp.ops.registry import moe_runner_backend
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.parallel.tbo_split import DEFAULT_THRESHOLD, micro_rows
from jaxdp.planner import xla_target
from jaxdp.planner.compile import abstract_sharded
from jaxdp.planner.hlo_checks import _COMPUTE, _collective_kind, _op_name, parse

SOL_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_analytical_sol_latency_estimator=true"
_SCOPE = re.compile(r'op_name="[^"]*tbo_mb([01])')


def micro_batch_of(line: str) -> int | None:
    """The micro-batch an HLO instruction was traced in (its op_name's scope), or None."""
    m = _SCOPE.search(line)
    return int(m.group(1)) if m else None


def _scope_of(mod, ins) -> int | None:
    """The micro-batch of an instruction, or of the collective an async-start wraps (the metadata is there)."""
    mb = micro_batch_of(ins.line)
    if mb is None and ins.opcode == "async-start":
        for comp in ins.calls():
            mb = next((m for i in mod.computations.get(comp, []) if (m := micro_batch_of(i.line)) is not None), None)
            if mb is not None:
                break
    return mb


def _collective_scope(mod, instrs, k: int, done_name: str | None) -> int | None:
    """The micro-batch of the collective at instrs[k]: its own scope, else (XLA:GPU leaves a ragged all-to-all's
    start without metadata) the scope of what reads its result (through views), else of what it reads."""
    ins = instrs[k]
    mb = _scope_of(mod, ins)
    if mb is not None:
        return mb
    by_name = {i.name: i for i in instrs}
    frontier, seen = {done_name or ins.name}, set()
    for _ in range(4):  # readers of the result
        readers = [i for i in instrs[k + 1:] if frontier & set(i.operands) and i.name not in seen]
        for i in readers:
            if (mb := _scope_of(mod, i)) is not None:
                return mb
        seen |= {i.name for i in readers}
        frontier = {i.name for i in readers}
    frontier = set(ins.operands)
    for _ in range(4):  # producers of its operands
        producers = [by_name[n] for n in frontier if n in by_name]
        for i in producers:
            if (mb := _scope_of(mod, i)) is not None:
                return mb
        frontier = {o for i in producers for o in i.operands}
    return None


def overlap_report(hlo_text: str) -> dict[str, Any]:
    """Per micro-batch collective of the scheduled HLO: (op, micro-batch, computation, asynchronous, the other
    micro-batch's compute instructions between its start and done and their names); `ok`: there is at least one
    and every one has some of the other's compute inside it."""
    mod = parse(hlo_text)
    rows = []
    for comp, instrs in mod.computations.items():
        if comp in mod.fused:
            continue
        position = {i.name: k for k, i in enumerate(instrs)}
        for k, ins in enumerate(instrs):
            kind = _collective_kind(mod, ins)
            if kind is None or ins.opcode.endswith("-done"):
                continue
            done = None
            if ins.opcode.endswith("-start"):
                done = next((j for j in instrs[k + 1:] if ins.name in j.operands and j.opcode.endswith("-done")), None)
            mb = _collective_scope(mod, instrs, k, done.name if done else None)
            if mb is None:
                continue
            row = {"op": kind, "micro_batch": mb, "computation": comp, "instruction": ins.name,
                   "async": ins.opcode.endswith("-start"), "other_compute": 0, "with": []}
            if row["async"]:
                between = instrs[k + 1: position[done.name]] if done else []
                other = [i for i in between if i.opcode in _COMPUTE and _scope_of(mod, i) == 1 - mb]
                row["other_compute"] = len(other)
                row["with"] = sorted({_op_name(i.line) or i.opcode for i in other})[:4]
            rows.append(row)
    for r in rows:
        r["in_scan"] = r["computation"] != mod.entry  # (the scan's body; outside: the peeled first / last layer)
    ok = bool(rows) and all(r["other_compute"] > 0 for r in rows)
    return {"ok": ok, "collectives": rows,
            "overlapped": sum(r["other_compute"] > 0 for r in rows), "total": len(rows)}


def format_report(name: str, report: dict[str, Any]) -> list[str]:
    """A table of one step's report."""
    goal = "met" if report["ok"] else "NOT met"
    lines = [f"{name}: {report['overlapped']} of {report['total']} micro-batch collectives overlapped with the "
             f"other micro-batch's compute: goal {goal}",
             "  mb  collective            async  other mb's compute inside (count: some names)"]
    for r in report["collectives"]:
        inside = f"{r['other_compute']}: {', '.join(r['with'])}" if r["other_compute"] else "none"
        where = " [layer scan]" if r.get("in_scan") else " [outside the scan: dense / first / last layer]"
        lines.append(f"  {r['micro_batch']}   {r['op']:<21} {'yes' if r['async'] else 'NO ':<5}  {inside}{where}")
    return lines


def compile_steps(layers: int, kinds: tuple[str, ...], gpu: str = "H200") -> dict[str, str]:
    """The scheduled HLO of each step ("<kind> split" / "<kind> whole"), DeepSeek-V3 FP8 at full width with
    `layers` layers (one dense), dp=8,moe=ep on 8 simulated GPUs."""
    cfg = preset_config("deepseek-v3").with_(num_layers=layers, first_k_dense_replace=1)
    layout = parse_mesh_spec("dp=8,moe=ep")
    devices = xla_target.gpu_devices(gpu, layout.world)
    mesh = layout.make_mesh(devices)
    platform = devices[0].platform
    page = 16
    runner = StepRunner(abstract_sharded(cfg, layout, mesh, "fp8"), layout, mesh, num_pages=16384, page_size=page,
                        cache_dtype=jnp.bfloat16, abstract=True, moe_backend=moe_runner_backend(None, platform),
                        decode_kernel=decode_kernels(None, platform))
    steps = {"decode": (True, 256, 256, 1024 // page), "extend": (False, 4096, 8, 4096 // page)}
    out = {}
    for kind in kinds:
        absorbed, rows, seqs, pages = steps[kind]
        m = micro_rows(rows, DEFAULT_THRESHOLD, absorbed, layout.tp)
        for name, mr in (("split", m), ("whole", 0)):
            shape = StepShape(absorbed, rows, seqs, pages, micro_rows=mr)
            out[f"{kind} {name}"] = runner.lower(shape).compile().as_text()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.planner.tbo_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of DeepSeek-V3 compiled (the first dense)")
    ap.add_argument("--kinds", default="decode,extend", help="steps: decode (256 rows a rank), extend (4,096)")
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--json", help="write the reports here")
    ap.add_argument("--dump", help="write each step's scheduled HLO into this folder")
    ap.add_argument("--estimator", choices=("sol", "default"), default="sol",
                    help="XLA:GPU's latency estimator for the latency-hiding scheduler: sol (its analytical "
                         "speed-of-light model) or default (XLA's approximate one)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (JAX stays on its CPU backend; XLA:GPU compiles, as plan does)
    if args.estimator == "sol":  # (read when the GPU client starts, which is after this)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SOL_FLAGS}".strip()
    texts = compile_steps(args.layers, tuple(args.kinds.split(",")), args.gpu)
    reports = {}
    for name, text in texts.items():
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, name.replace(" ", "_") + ".hlo"), "w") as f:
                f.write(text)
        reports[name] = overlap_report(text)
        print("\n".join(format_report(name, reports[name])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
