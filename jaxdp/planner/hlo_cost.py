"""FLOPs and HBM bytes of one device's optimized HLO module, counted from its text.

XLA's own cost analysis (`compiled.cost_analysis()`) answers None for a program compiled for simulated
GPUs (no device, no runtime), so `plan --compile` counts from the module XLA:GPU produced, as its
HloCostAnalysis would per kernel: every materialized instruction (a fusion, a GEMM, a collective, a copy)
reads its operands and writes its result once; an operand read only through a slice counts the slice (a
layer's weights out of the stacked ones), a buffer updated in place counts the update (the KV pool);
loop bodies count their trip count times. FLOPs are the dots' and GEMMs' 2 x M x N x K (elementwise
work is left out). The Pallas GEMMs that read one layer of a stacked weight (`kernels_pallas.fp8_gemm`,
`nvfp4_moe`) count 2 x M x N x K, their activations, one layer of their stacked operands and their output;
the other Pallas kernels (Triton custom calls) count their outputs only: what the MLA decode kernel reads
through a page table is not in the HLO.
"""

from __future__ import annotations

import math
import re

from jaxdp.planner.hlo_checks import VIEWS, Instr, Module, itemsize


def _bytes(ins: Instr) -> int:
    return sum(math.prod(d) * itemsize(t) for t, d in ins.arrays)


def _dims(line: str, key: str) -> list[int]:
    m = re.search(rf"{key}=\{{([\d,]*)\}}", line) or re.search(rf'"{key}":\[([^\]]*)\]', line)
    return [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []


# Pallas GEMMs on a layer stack: kernel name -> (operand index of x [M, K], indices of the [L, ...] operands)
LAYER_GEMMS = {"fp8_matmul": (2, (3, 4)), "stacked_matmul": (2, (3,)), "fp8_grouped_matmul": (6, (7, 8)),
               "nvfp4_grouped_matmul": (5, (6, 7, 8)), "fp8_head_matmul": (2, (3, 4)),
               "stacked_head_matmul": (2, (3,))}


def _layer_gemm_cost(ins: Instr, shapes: dict[str, Instr]) -> tuple[float, float] | None:
    """(FLOPs, bytes) of a LAYER_GEMMS kernel: x, one layer of each stacked operand, the output."""
    name = re.search(r'name = "([^"]+)"', ins.line)
    spec = LAYER_GEMMS.get(name.group(1)) if name else None
    if spec is None or not ins.arrays:
        return None
    x_at, stacked = spec
    ops = [shapes.get(n) for n in ins.operands]
    if len(ops) <= max(x_at, *stacked) or any(ops[k] is None or not ops[k].arrays for k in (x_at, *stacked)):
        return None
    x = ops[x_at]
    out = ins.arrays[0][1]
    flops = 2.0 * math.prod(out) * x.arrays[0][1][-1]
    read = _bytes(x) + sum(_bytes(ops[k]) / max(ops[k].arrays[0][1][0], 1) for k in stacked)
    return flops, read + _bytes(ins)


def _dot_flops(ins: Instr, shapes: dict[str, Instr]) -> float:
    lhs = shapes.get(ins.operands[0]) if ins.operands else None
    if lhs is None or not lhs.arrays:
        return 0.0
    key = "lhs_contracting_dims" if ins.opcode == "dot" else "lhs_contracting_dimensions"
    k = math.prod(lhs.arrays[0][1][d] for d in _dims(ins.line, key) if d < len(lhs.arrays[0][1]))
    out = ins.arrays[0][1] if ins.arrays else ()
    return 2.0 * math.prod(out) * k


class _Counter:
    def __init__(self, mod: Module):
        self.mod = mod
        self.shapes = {c: {i.name: i for i in instrs} for c, instrs in mod.computations.items()}

    def flops_in(self, comp: str) -> float:
        """The dots of a fused computation (and of fusions nested in it)."""
        total = 0.0
        for ins in self.mod.computations.get(comp, []):
            if ins.opcode == "dot":
                total += _dot_flops(ins, self.shapes[comp])
            total += sum(self.flops_in(c) for c in ins.calls())
        return total

    def read_bytes(self, ins: Instr, comp: str) -> int:
        """What a fusion reads: per operand, the whole buffer, or only the slices its fused body takes."""
        shapes = self.shapes[comp]
        body = ins.calls()[0] if ins.opcode == "fusion" and ins.calls() else None
        if ins.opcode in ("dynamic-update-slice", "scatter"):  # in place: only the update and indices are read
            return sum(_bytes(shapes[n]) for n in ins.operands[1:] if n in shapes)
        params = {}
        if body:
            for i in self.mod.computations.get(body, []):
                m = re.search(r"parameter\((\d+)\)", i.line) if i.opcode == "parameter" else None
                if m:
                    params[int(m.group(1))] = i.name
        total = 0
        for k, name in enumerate(ins.operands):
            operand = shapes.get(name)
            full = _bytes(operand) if operand else 0
            if body and k in params:
                users = [u for u in self.mod.computations[body] if params[k] in u.operands]
                if users and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == params[k]
                                 for u in users):
                    full = min(full, sum(_bytes(u) for u in users))
                elif users and all(u.opcode in ("dynamic-update-slice", "scatter") and u.operands[0] == params[k]
                                   for u in users):
                    full = 0  # updated in place: the update is counted as written
            total += full
        return total

    def written_bytes(self, ins: Instr, comp: str) -> int:
        body = ins.calls()[0] if ins.opcode == "fusion" and ins.calls() else None
        root = next((i for i in self.mod.computations.get(body, []) if i.line.lstrip().startswith("ROOT")),
                    None) if body else ins
        if root is not None and root.opcode in ("dynamic-update-slice", "scatter"):
            table = self.shapes[body] if body else self.shapes[comp]
            update = table.get(root.operands[-1] if root.opcode == "scatter" else root.operands[1])
            return _bytes(update) if update else 0
        return _bytes(ins)

    def count(self, comp: str) -> tuple[float, float]:
        flops = accessed = 0.0
        for ins in self.mod.computations.get(comp, []):
            if ins.opcode in VIEWS or ins.opcode.endswith("-done"):
                continue
            if ins.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.line)
                body = re.search(r"body=%([\w.\-]+)", ins.line)
                f, b = self.count(body.group(1)) if body else (0.0, 0.0)
                n = int(trips.group(1)) if trips else 1
                flops, accessed = flops + n * f, accessed + n * b
            elif ins.opcode in ("call", "conditional"):
                parts = [self.count(c) for c in ins.calls()]
                if parts:
                    f, b = max(parts) if ins.opcode == "conditional" else map(sum, zip(*parts, strict=True))
                    flops, accessed = flops + f, accessed + b
            elif ins.opcode == "custom-call" and "__gpu$xla.gpu.triton" in ins.line:
                gemm = _layer_gemm_cost(ins, self.shapes[comp])
                f, b = gemm if gemm else (0.0, _bytes(ins))
                flops, accessed = flops + f, accessed + b
            else:
                if ins.opcode == "fusion":
                    flops += sum(self.flops_in(c) for c in ins.calls())
                elif ins.opcode == "dot" or (ins.opcode == "custom-call" and "gemm" in ins.line):
                    flops += _dot_flops(ins, self.shapes[comp])
                accessed += self.read_bytes(ins, comp) + self.written_bytes(ins, comp)
        return flops, accessed


def hlo_cost(mod: Module) -> dict[str, float]:
    """{"flops", "bytes accessed"} of the entry computation, loops unrolled by their trip counts."""
    flops, accessed = _Counter(mod).count(mod.entry)
    return {"flops": flops, "bytes accessed": accessed}
