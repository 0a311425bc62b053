"""Checks on an optimized (XLA:GPU) HLO module: what `plan --compile` reports under each compiled step.

Each check reads the text of `executable.as_text()` (scheduled: instructions in a computation are listed in
the order they run) and returns a dict with `ok` and what it found:

- `fp8_weights`: every FP8 weight is widened inside the fusion that multiplies it; a convert from FP8
  outside any fusion holding a dot (or a GEMM custom call), whose output is as large as one layer's FP8
  weight, is a full-size bf16 copy of that weight in memory (what issue 14 left open).
- `layer_copies`: the layer scan reads each layer of a stacked array (weights, pool) where it lies; a
  non-GEMM instruction writing one layer of it is a copy (a write and a second read of that layer).
- `kernels`: the Pallas kernels, as `__gpu$xla.gpu.triton` custom calls, with their grids, against the
  grids the caller expects.
- `experts`: no materialized array holds the routed experts' work per expert over every row (a
  `[rows, E, N]` product, what XLA makes of `ragged_dot` where it has no grouped GEMM).
- `collectives`: each collective as a start/done pair (asynchronous) or not, and what runs between them
  (`collective_spans`, the walk the two-batch-overlap report reads too).

"Materialized" means the result of an instruction of a computation that is not fused (the entry, loop
bodies and the like), parameters and views (bitcast, get-tuple-element, tuple) excepted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

_FLOAT_WIDE = ("bf16", "f16", "f32")
VIEWS = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant", "copy-start", "copy-done"}
_GEMM_CALLS = ("__cublas", "__cudnn", "__triton_gemm", "gemm")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute", "collective-broadcast")
COMPUTE = {"fusion", "custom-call", "dot", "convolution", "while", "conditional", "call"}


def itemsize(hlo_dtype: str) -> int:
    """Bytes per element of an HLO element type (bf16: 2, f8e4m3fn: 1, pred: 1; an unknown one: 4)."""
    if hlo_dtype == "pred" or hlo_dtype.startswith(("f8", "s8", "u8")):
        return 1
    bits = re.search(r"(\d+)", hlo_dtype)
    return max(1, int(bits.group(1)) // 8) if bits else 4


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # "bf16[2,3]{1,0}" or a tuple "(f32[2]{0}, s32[])"
    opcode: str
    operands: list[str]
    line: str

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in re.findall(r"(\w+)\[([\d,]*)\]",
                                                                                          self.type)]

    def calls(self) -> list[str]:
        found = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", self.line)
        for group in re.findall(r"(?:calls|branch_computations)=\{([^}]*)\}", self.line):
            found += re.findall(r"%([\w.\-]+)", group)
        return found


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    fused: set[str]  # computations that are the body of a fusion (or wrapped in an async op)

    def materialized(self):
        """(computation, instruction) for every buffer an unfused computation writes."""
        for comp, instrs in self.computations.items():
            if comp in self.fused:
                continue
            for ins in instrs:
                if ins.opcode not in VIEWS:
                    yield comp, ins

    def reaches(self, comp: str, pred, seen: set[str] | None = None) -> bool:
        """Whether an instruction of `comp` or of a computation it calls satisfies `pred`."""
        seen = set() if seen is None else seen
        if comp in seen or comp not in self.computations:
            return False
        seen.add(comp)
        return any(pred(i) or any(self.reaches(c, pred, seen) for c in i.calls()) for i in self.computations[comp])


def _split_type(rest: str) -> tuple[str, str]:
    """'(f32[2]{0}, s32[]) all-reduce-start(...' -> (type, remainder)."""
    if not rest.startswith("("):
        t, _, tail = rest.partition(" ")
        return t, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 2:]
    return rest, ""


def parse(hlo_text: str) -> Module:
    computations: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            if line.endswith("{"):
                head = line.split(" ", 2)
                name = (head[1] if head[0] == "ENTRY" else head[0]).lstrip("%")
                entry = name if head[0] == "ENTRY" else entry
                current = computations.setdefault(name, [])
            else:
                current = None
            continue
        m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (.*)$", line)
        if current is None or not m:
            continue
        typ, tail = _split_type(m.group(2))
        op = re.match(r"([\w\-]+)\((.*)", tail)
        if not op:
            continue
        operands = re.findall(r"%([\w.\-]+)", op.group(2).split("), ")[0])
        current.append(Instr(m.group(1), typ, op.group(1), operands, line))
    fused = set()
    for instrs in computations.values():
        for ins in instrs:
            if ins.opcode in ("fusion", "async-start") or ins.opcode.endswith("-start"):
                fused.update(ins.calls())
    return Module(computations, entry, fused)


def _elements(dims: tuple[int, ...]) -> int:
    return math.prod(dims)


def _is_gemm(ins: Instr) -> bool:
    return ins.opcode in ("dot", "convolution") or (ins.opcode == "custom-call" and any(
        g in ins.line for g in _GEMM_CALLS))


def fp8_weight_sizes(mod: Module) -> set[int]:
    """Element counts of one layer of each FP8 weight: the entry's FP8 parameters (stacked [layers, ...])."""
    sizes = set()
    for ins in mod.computations.get(mod.entry, []):
        if ins.opcode != "parameter":
            continue
        for dtype, dims in ins.arrays:
            if dtype.startswith("f8") and dims:
                sizes.add(_elements(dims[1:]) if len(dims) >= 3 else _elements(dims))
    return sizes


def check_fp8_weights(mod: Module) -> dict[str, Any]:
    sizes = fp8_weight_sizes(mod)
    if not sizes:
        return {"ok": True, "fp8_weights": 0, "copies": [], "note": "no FP8 weights"}
    smallest = min(sizes)
    types = {i.name: i for instrs in mod.computations.values() for i in instrs}
    copies = []
    for comp, ins in mod.materialized():
        wide = [d for t, d in ins.arrays if t in _FLOAT_WIDE and _elements(d) >= smallest]
        if not wide:
            continue
        if ins.opcode == "convert":
            src = types.get(ins.operands[0]) if ins.operands else None
            reads_fp8 = src is not None and any(t.startswith("f8") for t, _ in src.arrays)
            has_gemm = False
        elif ins.opcode == "fusion":
            body = ins.calls()
            reads_fp8 = any(mod.reaches(c, lambda i: i.opcode == "convert" and any(
                t.startswith("f8") for t, _ in types.get(i.operands[0], Instr("", "", "", [], "")).arrays)
                if i.operands else False) for c in body)
            has_gemm = any(mod.reaches(c, _is_gemm) for c in body)
        else:
            continue
        if reads_fp8 and not has_gemm:
            dims = max(wide, key=_elements)
            copies.append({"shape": f"{[t for t, d in ins.arrays if d == dims][0]}[{','.join(map(str, dims))}]",
                           "elements": _elements(dims), "instruction": ins.name, "computation": comp,
                           "op": op_name(ins.line), "weight_sized": _elements(dims) in sizes})
    copies.sort(key=lambda c: -c["elements"])
    return {"ok": not copies, "fp8_weights": len(sizes), "smallest_layer_weight_elements": smallest,
            "copies": copies[:8]}


def check_layer_copies(mod: Module, min_bytes: int = 2**20) -> dict[str, Any]:
    """Stacked arrays (the layers' weights, [layers, ...], and the pool) read in place: a materialized
    instruction that is not a GEMM, slices (a dynamic-slice, a copy, or a fusion holding a dynamic-slice: the
    layer scan's index) and writes one layer of a stacked entry parameter, same dtype and shape (a copy out of
    the layer scan's stack), costs a write and a second read of that layer. (An activation whose shape happens
    to be a layer's, e.g. 512 decode rows x the hidden size against a shared expert's [512, hidden] slice, is
    not a slice of anything.)"""
    def squeeze(dims):
        return tuple(d for d in dims if d != 1)

    layers = {(t, squeeze(d[1:])) for i in mod.computations.get(mod.entry, []) if i.opcode == "parameter"
              for t, d in i.arrays if len(d) >= 3}
    copies = []
    for comp, ins in mod.materialized():
        if ins.opcode not in ("fusion", "copy", "dynamic-slice") or (ins.opcode == "fusion" and (
                any(mod.reaches(c, _is_gemm) for c in ins.calls())
                or not any(mod.reaches(c, lambda i: i.opcode == "dynamic-slice") for c in ins.calls()))):
            continue
        for dtype, dims in ins.arrays:
            nbytes = _elements(dims) * itemsize(dtype)
            if nbytes >= min_bytes and (dtype, squeeze(dims)) in layers:
                copies.append({"shape": f"{dtype}[{','.join(map(str, dims))}]", "bytes": nbytes,
                               "instruction": ins.name, "computation": comp, "op": op_name(ins.line)})
    copies.sort(key=lambda c: -c["bytes"])
    return {"ok": not copies, "copies": copies[:8], "count": len(copies),
            "bytes_per_pass": sum(c["bytes"] for c in copies)}


def op_name(line: str) -> str:
    """The last part of an instruction's op_name (the traced operation it comes from), or ''."""
    op = re.search(r'op_name="([^"]*)"', line)
    return op.group(1).rsplit("/", 2)[-1] if op else ""


def triton_calls(mod: Module) -> list[dict[str, Any]]:
    """The Pallas kernels compiled by Triton: name, grid and the computation they run in."""
    out = []
    for comp, instrs in mod.computations.items():
        for ins in instrs:
            if ins.opcode == "custom-call" and "__gpu$xla.gpu.triton" in ins.line:
                grid = tuple(int(re.search(rf"grid_{a} = (\d+)", ins.line).group(1)) for a in "xyz")
                name = re.search(r'name = "([^"]+)"', ins.line)
                out.append({"name": name.group(1) if name else "?", "grid": grid, "computation": comp})
    return out


def check_kernels(mod: Module, expected: dict[str, list[tuple[int, int, int]]]) -> dict[str, Any]:
    """expected: kernel name -> the grids it may run with (where the rows it sees could be one of several
    counts, several); each kernel must be there, with no grid outside its list."""
    found = triton_calls(mod)
    problems = []
    for name, grids in expected.items():
        have = sorted({c["grid"] for c in found if c["name"] == name})
        if not have:
            problems.append(f"{name} is not a Triton custom call")
        elif not set(have) <= set(grids):
            problems.append(f"{name} runs with grids {have}, expected {sorted(set(grids))}")
    return {"ok": not problems, "found": found, "expected": {k: sorted(set(v)) for k, v in expected.items()},
            "grids": {k: sorted({c["grid"] for c in found if c["name"] == k}) for k in expected},
            "problems": problems}


def check_experts(mod: Module, experts: int, rows: set[int], widths: set[int]) -> dict[str, Any]:
    """experts: routed experts on one device; rows: the row counts the MoE can see; widths: the experts'
    output widths (2 x intermediate, intermediate, hidden). Flags a materialized array holding a rows, an
    experts and a width dimension: the [rows, experts, width] product XLA makes of `ragged_dot`."""
    expanded = []
    for comp, ins in mod.materialized():
        if ins.opcode in ("while", "conditional", "call"):  # their results are the loop's state, held elsewhere
            continue
        for dtype, dims in ins.arrays:
            big = list(dims)
            has_rows = [r for r in rows if r in big and r != experts]
            per_expert = bool(has_rows) and experts in big and any(
                w in big for w in widths if w not in (experts, *has_rows))
            if per_expert:
                expanded.append({"shape": f"{dtype}[{','.join(map(str, dims))}]", "instruction": ins.name,
                                 "computation": comp, "op": op_name(ins.line)})
    return {"ok": not expanded, "experts_per_device": experts, "expanded": expanded[:6]}


@dataclasses.dataclass
class CollectiveSpan:
    """One collective of an unfused computation as scheduled: asynchronous (`start` with its `done`, and the
    instructions the schedule runs between them) or synchronous (`start` alone, `done` None, nothing between)."""

    kind: str  # "all-gather", "ragged-all-to-all", ...
    computation: str
    index: int  # the start's position in its computation
    start: Instr
    done: Instr | None
    between: list[Instr]

    @property
    def is_async(self) -> bool:
        return self.start.opcode.endswith("-start")

    @property
    def compute(self) -> list[Instr]:
        """The compute scheduled inside (what can overlap the transfer)."""
        return [i for i in self.between if i.opcode in COMPUTE]


def collective_spans(mod: Module) -> list[CollectiveSpan]:
    """Every collective of every unfused computation, in schedule order (the one walk `check_collectives` and
    the two-batch-overlap report, `jaxdp.planner.tbo_report`, read)."""
    spans = []
    for comp, instrs in mod.computations.items():
        if comp in mod.fused:
            continue
        position = {i.name: k for k, i in enumerate(instrs)}
        for k, ins in enumerate(instrs):
            kind = collective_kind(mod, ins)
            if kind is None or ins.opcode.endswith("-done"):
                continue
            done = None
            if ins.opcode.endswith("-start"):
                done = next((j for j in instrs[k + 1:] if ins.name in j.operands and j.opcode.endswith("-done")),
                            None)
            between = instrs[k + 1: position[done.name]] if done else []
            spans.append(CollectiveSpan(kind, comp, k, ins, done, between))
    return spans


def check_collectives(mod: Module) -> dict[str, Any]:
    """Every collective: asynchronous (a start with its done) or synchronous, and what the schedule puts
    between a start and its done (compute that overlaps the transfer)."""
    pairs, sync = [], []
    for s in collective_spans(mod):
        if s.is_async:
            work = s.compute
            pairs.append({"op": s.kind, "computation": s.computation, "done": s.done is not None,
                          "overlapped": len(work), "with": sorted({op_name(i.line) or i.opcode for i in work})[:4]})
        else:
            sync.append({"op": s.kind, "computation": s.computation, "instruction": s.start.name})
    ok = not sync and all(p["done"] for p in pairs)
    return {"ok": ok, "async": len(pairs), "overlapped": sum(p["overlapped"] > 0 for p in pairs),
            "sync": sync[:8], "pairs": pairs}


def collective_kind(mod: Module, ins: Instr) -> str | None:
    """The collective an instruction is, or starts (its `-start`, or an async wrapper of it); None otherwise."""
    op = ins.opcode
    for c in sorted(_COLLECTIVES, key=len, reverse=True):
        if op in (c, f"{c}-start"):
            return c
    if op == "async-start":  # a collective wrapped in an async computation (e.g. all-to-all, ragged)
        for comp in ins.calls():
            for i in mod.computations.get(comp, []):
                if i.opcode in _COLLECTIVES:
                    return i.opcode
    return None


def summary_line(name: str, check: dict[str, Any]) -> str:
    """One line of the report for a check."""
    mark = "ok  " if check["ok"] else "FAIL"
    if name == "fp8_weights":
        if not check["fp8_weights"]:
            return f"{mark} quantized weights: none in this model"
        if check["ok"]:
            return f"{mark} quantized weights: every one widened inside its dot fusion (no bf16 copy outside a GEMM)"
        c = check["copies"][0]
        return (f"{mark} quantized weights: {len(check['copies'])} converted outside a dot fusion, largest "
                f"{c['shape']} ({c['op'] or c['instruction']}{', one layer' if c['weight_sized'] else ''})")
    if name == "layer_copies":
        if check["ok"]:
            return f"{mark} stacked layers read in place (no layer of a weight copied out of its stack)"
        c = check["copies"][0]
        return (f"{mark} stacked layers copied before use: {check['count']} arrays, "
                f"{check['bytes_per_pass'] / 2**20:,.0f} MiB a pass of the loop, largest {c['shape']} ({c['op']})")
    if name == "kernels":
        kinds = ", ".join(f"{n} grid {'/'.join('x'.join(map(str, g)) for g in gs)}"
                          for n, gs in check["grids"].items())
        if check["ok"]:
            return f"{mark} Pallas kernels as Triton custom calls: {kinds or 'none expected'}"
        return f"{mark} Pallas kernels: " + "; ".join(check["problems"])
    if name == "experts":
        if check["ok"]:
            return f"{mark} routed experts: no [rows, experts, ...] product ({check['experts_per_device']} per device)"
        return f"{mark} routed experts expanded per expert: " + ", ".join(
            f"{e['shape']} ({e['op'] or e['instruction']})" for e in check["expanded"][:3])
    if name == "collectives":
        ops = sorted({p["op"] for p in check["pairs"]})
        head = (f"{mark} collectives: {check['async']} asynchronous ({', '.join(ops) or '-'}), "
                f"{check['overlapped']} with compute scheduled inside")
        return head + (f"; synchronous: {', '.join(sorted({s['op'] for s in check['sync']}))}" if check["sync"] else "")
    raise ValueError(name)
