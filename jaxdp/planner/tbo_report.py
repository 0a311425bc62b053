"""Two-batch overlap on paper: which compute XLA:GPU's schedule puts inside each collective of a micro-batch.

`python -m jaxdp.planner.tbo_report` compiles DeepSeek-V3 (block FP8, full width, few layers: `--layers`, the
first of them dense) under `dp=8,moe=ep` for 8 simulated H200s (the planner's deviceless XLA:GPU path,
`jaxdp.planner.xla_target`, with the XLA flags the server sets for two-batch overlap on a GPU,
`jaxdp.parallel.tbo.xla_flags`), a decode step of 256 rows a rank and a prompt step of 4,096 tokens a rank, each
split into two micro-batches (`jaxdp.parallel.tbo`) and, as the control, whole. In the scheduled HLO (the walk of
`hlo_checks.collective_spans`) each collective of the layers and of the LM head belongs to the micro-batch whose
named scope (`tbo_mb0` / `tbo_mb1` in the layers, `lm_head_mb0` / `lm_head_mb1` in the head,
`jaxdp.model.decoder`) it carries; for an asynchronous one (start .. done) the report lists the other
micro-batch's compute scheduled between its start and its done. The goal, per collective: the other micro-batch
computes inside it (none synchronous, none combined from both micro-batches', none with nothing of the other
inside). A step without the split has no micro-batch collectives and fails the goal.
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
from jaxdp.parallel.tbo import xla_flags as tbo_xla_flags
from jaxdp.parallel.tbo_split import DEFAULT_THRESHOLD, micro_rows
from jaxdp.planner import xla_target
from jaxdp.planner.compile import abstract_sharded
from jaxdp.planner.hlo_checks import CollectiveSpan, Instr, Module, collective_spans, op_name, parse

SOL_FLAG = "xla_gpu_enable_analytical_sol_latency_estimator"
_SCOPES = re.compile(r"(?:tbo|lm_head)_mb([01])")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def micro_batches_of(line: str) -> set[int]:
    """The micro-batches an HLO instruction was traced in (the scopes its op_name names: two where XLA merged
    both micro-batches' operations into one)."""
    m = _OP_NAME.search(line)
    return {int(k) for k in _SCOPES.findall(m.group(1))} if m else set()


def micro_batch_of(line: str) -> int | None:
    """The one micro-batch an HLO instruction was traced in, or None (none, or both)."""
    found = micro_batches_of(line)
    return found.pop() if len(found) == 1 else None


def _traced_as(mod: Module, ins: Instr) -> str:
    """An instruction's op_name, or that of the collective an async-start wraps (the metadata is there); ''."""
    m = _OP_NAME.search(ins.line)
    if m is None and ins.opcode == "async-start":
        m = next((n for c in ins.calls() for i in mod.computations.get(c, []) if (n := _OP_NAME.search(i.line))),
                 None)
    return m.group(1) if m else ""


def _scopes(mod: Module, ins: Instr) -> set[int]:
    """The micro-batches of an instruction, or of the collective an async-start wraps."""
    return {int(k) for k in _SCOPES.findall(_traced_as(mod, ins))}


def _nearest_scopes(mod: Module, instrs: list[Instr], span: CollectiveSpan, upstream: bool) -> set[int]:
    """The micro-batches of the nearest scoped instructions that feed the collective (upstream) or read its
    result (downstream), within four steps through unscoped ones."""
    by_name = {i.name: i for i in instrs}
    if upstream:
        frontier = [by_name[n] for n in span.start.operands if n in by_name]
    else:
        names = {(span.done or span.start).name}
        frontier = [i for i in instrs[span.index + 1:] if names & set(i.operands)]
    seen: set[str] = set()
    for _ in range(4):
        found = set().union(*(_scopes(mod, i) for i in frontier))
        if found:
            return found
        seen |= {i.name for i in frontier}
        if upstream:
            frontier = [by_name[n] for i in frontier for n in i.operands if n in by_name and n not in seen]
        else:
            names = {i.name for i in frontier}
            frontier = [i for i in instrs[span.index + 1:] if names & set(i.operands) and i.name not in seen]
    return set()


def _collective_scopes(mod: Module, span: CollectiveSpan) -> set[int]:
    """The micro-batch(es) of a collective: its own scopes (both: XLA combined the two micro-batches' collectives
    into one; none: traced outside them); without metadata (XLA:GPU leaves a ragged all-to-all's start so) those
    of what feeds it (its
    buffers and offsets, which are its micro-batch's alone), else of what reads its result; where one side names
    both micro-batches (XLA fused the two micro-batches' operations into one), the other side decides."""
    if _traced_as(mod, span.start):  # (traced outside both micro-batches, e.g. the LM head's: none)
        return _scopes(mod, span.start)
    instrs = mod.computations[span.computation]
    up = _nearest_scopes(mod, instrs, span, upstream=True)
    if len(up) == 1:
        return up
    down = _nearest_scopes(mod, instrs, span, upstream=False)
    return down if len(down) == 1 or not up else up


def overlap_report(hlo_text: str) -> dict[str, Any]:
    """Per micro-batch collective of the scheduled HLO (`hlo_checks.collective_spans`, the walk `plan --compile`'s
    collectives check reads): its op, micro-batch ("both" where XLA combined the two micro-batches' into one: a
    point where each waits for the other, never overlapped), computation, whether asynchronous, and the other
    micro-batch's compute instructions between its start and its done (count and names); `ok`: there is at least
    one and every one has some of the other's compute inside it."""
    mod = parse(hlo_text)
    rows = []
    for span in collective_spans(mod):
        mbs = _collective_scopes(mod, span)
        if not mbs:
            continue
        mb = mbs.pop() if len(mbs) == 1 else "both"
        row = {"op": span.kind, "micro_batch": mb, "computation": span.computation,
               "instruction": span.start.name, "async": span.is_async, "other_compute": 0, "with": [],
               "in_scan": span.computation != mod.entry,  # (the scan's body; outside: the peeled layers, the head)
               "lm_head": "lm_head_mb" in _traced_as(mod, span.start)}
        if span.is_async and mb != "both":
            other = [i for i in span.compute if 1 - mb in _scopes(mod, i)]
            row["other_compute"] = len(other)
            row["with"] = sorted({op_name(i.line) or i.opcode for i in other})[:4]
        rows.append(row)
    ok = bool(rows) and all(r["other_compute"] > 0 for r in rows)
    whole_head = [s for s in collective_spans(mod)
                  if "lm_head" in _traced_as(mod, s.start) and not _scopes(mod, s.start)]
    return {"ok": ok, "collectives": rows,
            "overlapped": sum(r["other_compute"] > 0 for r in rows), "total": len(rows),
            "whole_lm_head": {"total": len(whole_head), "with_compute": sum(bool(s.compute) for s in whole_head)}}


def format_report(name: str, report: dict[str, Any]) -> list[str]:
    """A table of one step's report."""
    goal = "met" if report["ok"] else "NOT met"
    lines = [f"{name}: {report['overlapped']} of {report['total']} micro-batch collectives overlapped with the "
             f"other micro-batch's compute: goal {goal}",
             "  mb   collective            async  other mb's compute inside (count: some names)"]
    for r in report["collectives"]:
        inside = f"{r['other_compute']}: {', '.join(r['with'])}" if r["other_compute"] else "none"
        if r["micro_batch"] == "both":
            inside = "none: both micro-batches' in one (XLA combined them)"
        where = (" [layer scan]" if r["in_scan"] else " [LM head]" if r["lm_head"]
                 else " [outside the scan: dense / first / last layer]")
        lines.append(f"  {r['micro_batch']:<5}{r['op']:<21} {'yes' if r['async'] else 'NO ':<5}  {inside}{where}")
    head = report["whole_lm_head"]
    if head["total"]:
        lines.append(f"  the LM head, whole (no micro-batch's): {head['with_compute']} of {head['total']} "
                     "collectives with compute inside")
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
                         "speed-of-light model, what the server sets for two-batch overlap) or default (XLA's "
                         "approximate one)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (JAX stays on its CPU backend; XLA:GPU compiles, as plan does)
    # the server's XLA_FLAGS for two-batch overlap on a GPU (read when the GPU client starts, which is after this);
    # --estimator default overrides its latency estimator, as a user's own flag would
    flags = os.environ.get("XLA_FLAGS", "")
    if args.estimator == "default":
        flags = f"{flags} --{SOL_FLAG}=false"
    os.environ["XLA_FLAGS"] = tbo_xla_flags(flags, "cuda")
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
