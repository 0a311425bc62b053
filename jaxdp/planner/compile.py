"""`plan --compile`: the engine's real step functions compiled by XLA for a full-size model on abstract
weights, XLA's memory analysis per device beside the plan's bytes.

Nothing is allocated: the weights are the loader's description of the model (`jaxdp.model.sharded.
abstract_state`: ShapeDtypeStructs in the checkpoint's dtypes, each in its final sharding), the StepRunner
takes them with an abstract KV pool of the planned size (latents and DSA index keys), and
each step is lowered and compiled for the layout's devices: simulated GPUs of the plan's kind under XLA:GPU
(`jaxdp.planner.xla_target`; the step then takes the GPU's own paths: Pallas kernels, ragged all-to-all,
and XLA:GPU's fusions and temps; docs/gpu-on-paper.md), or host devices under XLA:CPU (created for it, as
`serve` does on a CPU machine), whose temps differ from a GPU's (docs/plan.md). On XLA:GPU each step's
optimized HLO is checked (`jaxdp.planner.hlo_checks`) and XLA's cost analysis is set against the HBM floor.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxdp.engine.step.buckets import Buckets
from jaxdp.eplb.slots import initial_placement, with_expert_slots
from jaxdp.layout import ensure_host_devices
from jaxdp.model.sharded import (
    ShardedModel,
    _dotted,
    abstract_mtp,
    abstract_state,
    check_fp8_split,
    param_table,
    resolve_quantization,
    table_of,
)
from jaxdp.ops.attention import decode_kernels
from jaxdp.ops.registry import moe_runner_backend
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.planner import xla_target
from jaxdp.planner.gpu_report import check_step, format_gpu, step_collectives, step_cost
from jaxdp.planner.hlo_checks import itemsize
from jaxdp.planner.weights import kv_bytes, total_bytes, weights_per_device

GiB = 2**30
PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class CompileCase:
    """Which steps to compile: the largest decode and extend buckets per rank."""

    decode_rows: int = 512  # SGLang's largest CUDA-graph batch, per rank
    extend_rows: int = 4096  # one prompt chunk per rank
    context: int = 1024  # tokens of context per decoding request
    page_size: int = PAGE_SIZE
    kinds: tuple[str, ...] = ("decode", "extend")
    moe_backend: str | None = None  # the routed experts' grouped matmul (--moe-runner-backend; None: the target's)
    target: str = "cpu"  # "gpu": XLA:GPU for the plan's GPU (jaxdp.planner.xla_target); "cpu": XLA:CPU
    attention_backend: str | None = None  # --attention-backend (None: the target's: pallas on a GPU)
    draft_tokens: int = 0  # speculative decoding (--speculative-num-steps): the steps verify and draft this many
    dcp_size: int = 1  # --dcp-size: the pool split token-wise over the group's devices (jaxdp.parallel.dcp)


# --expert-dtype -> the loader's quantization: fp8 is a DeepSeek block-FP8 checkpoint (every Linear of the
# layers FP8 with its block scales, as loading DeepSeek-V3's own checkpoint holds it), nvfp4 the NVFP4 experts
QUANTIZATION = {"bf16": None, "fp8": "fp8", "nvfp4": "nvfp4"}


def abstract_sharded(cfg: Any, layout: Any, mesh: Any, expert_dtype: str):
    """The model as the loader would hold it under `layout`, without weights: `jaxdp.model.sharded`'s
    description of every parameter (shape, dtype, PartitionSpec) as ShapeDtypeStructs on `mesh`, bf16
    where not quantized. A layout whose FP8 weights do not split into whole scale blocks is refused as
    the loader refuses it."""
    quantization = QUANTIZATION[expert_dtype]
    rcfg, _ = resolve_quantization(cfg, quantization)
    if rcfg.fp8_block:
        check_fp8_split(param_table(cfg, layout, jnp.bfloat16, quantization), mesh, layout, rcfg.fp8_block[0])
    return ShardedModel(rcfg, *abstract_state(cfg, layout, mesh, jnp.bfloat16, quantization))


def abstract_draft(cfg: Any, layout: Any, mesh: Any, expert_dtype: str):
    """The model's MTP layer (speculative decoding's draft model) as the loader would hold it under `layout`
    (`jaxdp.model.sharded.load_mtp_sharded`), without weights: ShapeDtypeStructs in their final sharding on
    `mesh`. Block FP8 as the main layers; NVFP4 exports leave the MTP layer unquantized (bf16 experts, as
    `jaxdp.planner.weights.mtp_component` counts it)."""
    quantization = None if expert_dtype == "nvfp4" else QUANTIZATION[expert_dtype]
    rcfg, _ = resolve_quantization(cfg, quantization)
    abstract = abstract_mtp(cfg, jnp.bfloat16, quantization)
    table = table_of(abstract, layout)
    if rcfg.fp8_block:
        check_fp8_split(table, mesh, layout, rcfg.fp8_block[0])
    graphdef, state = nnx.split(abstract)
    return ShardedModel(rcfg, graphdef, jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, table[_dotted(p)].spec)),
        state))


def step_shapes(layout: Any, case: CompileCase) -> list:
    """The largest decode bucket, and the largest extend bucket in MAX_LEN and (with dp > 1) SUM_LEN. Speculating
    (`case.draft_tokens` D), every step the server runs is a speculative one (`jaxdp.parallel.spec_step`), shaped
    as `jaxdp.engine.step.buckets.Buckets.shapes` shapes them: the decode bucket's requests verifying only (D + 1 rows
    each, the absorbed form) and the largest extend bucket (the extend form: a prompt chunk beside the other
    requests' verifies, as many requests as the decode bucket holds), in the gather mode the engine gives it."""
    pages = -(-max(case.context, case.extend_rows) // case.page_size)
    if case.draft_tokens:
        d = case.draft_tokens
        rows = case.decode_rows * (d + 1)
        modes = Buckets.make(case.decode_rows, case.extend_rows, layout.dp, decode=[case.decode_rows],
                             extend=[max(case.extend_rows, rows)], draft_tokens=d).extend_modes(case.extend_rows)
        mode, sum_rows = modes[-1]  # the largest exact buffer (SUM_LEN) where the engine gathers exactly
        shapes = [StepShape(True, rows, rows, -(-case.context // case.page_size), draft_tokens=d),
                  StepShape(False, case.extend_rows, min(case.extend_rows, case.decode_rows), pages, mode, sum_rows,
                            draft_tokens=d)]
        return [s for s, k in zip(shapes, ("decode", "extend"), strict=True) if k in case.kinds]
    shapes = [StepShape(True, case.decode_rows, case.decode_rows, -(-case.context // case.page_size)),
              StepShape(False, case.extend_rows, 1, pages)]
    if layout.dp > 1:
        shapes.append(StepShape(False, case.extend_rows, 1, pages, "sum_len", layout.dp * case.extend_rows))
    return [s for s in shapes if s.kind in case.kinds]


def compile_plan(cfg: Any, layout: Any, plan: dict[str, Any], case: CompileCase, gpu: Any) -> dict[str, Any]:
    """Compile the steps of `step_shapes` for `cfg` under `layout` with the planned KV pool; returns the
    JSON part {"compiled": [...], "fit": {...}}. Under XLA:CPU, JAX must not have started with fewer host
    devices than the layout has (`jaxdp.layout.ensure_host_devices` before it starts)."""
    expert_dtype, kv_dtype = plan["expert_dtype"], plan["kv_dtype"]
    if kv_dtype != "bf16":
        raise ValueError("--compile runs jaxdp's own step, whose KV pool is bf16 (an fp8 pool is not implemented "
                         "yet); use --kv-dtype bf16 with --compile.")
    on_gpu = case.target == "gpu"
    if on_gpu:
        devices = xla_target.gpu_devices(gpu.name, layout.total_devices)
    else:
        ensure_host_devices(layout.total_devices)
        devices = jax.devices()[: layout.total_devices]
    tokens = plan["plan"]["kv_tokens_per_rank"]
    num_pages = max(1, tokens // case.page_size)
    spec = case.draft_tokens > 0  # the MTP layer's weights and its draft KV (one more layer of entries) too
    kv = kv_bytes(cfg, kv_dtype, include_mtp=spec)
    per_token = kv.per_token / case.dcp_size  # on one device (--dcp-size: 1/dcp of each of the group's tokens)
    planned_kv = int(num_pages * case.page_size * per_token)  # latents and (DSA) index keys, bf16
    redundant = plan.get("num_redundant_experts", 0)
    planned_w = total_bytes(weights_per_device(cfg, layout, expert_dtype, placement="jaxdp", include_mtp=spec,
                                               num_redundant_experts=redundant))

    mesh = layout.make_mesh(devices)
    platform = devices[0].platform
    model = abstract_sharded(cfg, layout, mesh, expert_dtype)
    if redundant:  # E + R expert slots and the expert map, as the server holds them (jaxdp.eplb.slots)
        model = with_expert_slots(model, initial_placement(cfg, layout, redundant), layout, mesh)
    draft = abstract_draft(cfg, layout, mesh, expert_dtype) if spec else None
    kernels, moe = decode_kernels(case.attention_backend, platform), moe_runner_backend(case.moe_backend, platform)
    runner, one_page = (StepRunner(model, layout, mesh, num_pages=n, page_size=case.page_size, draft=draft,
                                   cache_dtype=jnp.bfloat16, abstract=True, moe_backend=moe, decode_kernel=kernels,
                                   dcp_size=case.dcp_size)
                        for n in (num_pages, 1))
    compiled = []
    for shape in step_shapes(layout, case):
        t0 = time.perf_counter()
        executable = runner.lower(shape).compile()
        seconds = time.perf_counter() - t0
        mem = executable.memory_analysis()
        arg = int(mem.argument_size_in_bytes)
        if on_gpu:  # XLA:GPU scatters into the pool in place: the temp is the step's own
            small, temp_without_pool = executable, int(mem.temp_size_in_bytes)
        else:  # XLA:CPU scatters into a bf16 pool through float32 copies of the whole pool: the same step on a
            # one-page pool gives the temp without them
            small = one_page.lower(shape).compile()
            temp_without_pool = int(small.memory_analysis().temp_size_in_bytes)
        text = small.as_text()
        entry = {
            "kind": step_kind(shape), "rows_per_rank": shape.num_rows, "seqs_per_rank": shape.num_seqs,
            "draft_tokens": shape.draft_tokens,
            "gather_mode": shape.gather_mode, "sum_rows": shape.sum_rows,
            "argument_bytes_per_device": arg, "output_bytes_per_device": int(mem.output_size_in_bytes),
            "alias_bytes_per_device": int(mem.alias_size_in_bytes),
            "temp_bytes_per_device": int(mem.temp_size_in_bytes),
            "temp_bytes_without_pool_copies_per_device": temp_without_pool,
            "generated_code_bytes_per_device": int(mem.generated_code_size_in_bytes),
            "planned_weight_bytes_per_device": int(planned_w), "planned_kv_bytes_per_device": int(planned_kv),
            "argument_vs_plan": arg / (planned_w + planned_kv) - 1, "compile_s": round(seconds, 2),
            "largest_buffers": largest_buffers(text, in_place=on_gpu),  # what temp* is made of
            "collective_buffers": collective_buffers(text),
        }
        if on_gpu:
            entry["cost"] = step_cost(executable, text, shape, gpu, planned_w, kv.per_token, case.page_size)
            entry["checks"] = check_step(text, cfg, layout, shape, case.page_size, expert_dtype, moe,
                                         kernels.name == "pallas", redundant, case.dcp_size)
            entry["collectives"] = step_collectives(text)
        compiled.append(entry)
    return {"compiled": compiled, "fit": _fit(compiled, planned_kv, per_token, tokens, gpu.memory_bytes),
            "host_devices": layout.total_devices, "nodes": len({d.process_index for d in devices}),
            "backend": platform, "page_size": case.page_size,
            "num_pages_per_rank": num_pages, "target": case.target, "draft_tokens": case.draft_tokens,
            "device_kind": devices[0].device_kind, "moe_runner_backend": moe,
            "attention_backend": kernels.name,
            "target_description": xla_target.target_fields(xla_target.target_description(gpu.name)) if on_gpu
            else None}


def step_kind(shape: Any) -> str:
    """decode, extend, or a speculative step in either form: spec-decode (verifies only), spec-extend."""
    form = "decode" if shape.absorbed else "extend"
    return f"spec-{form}" if shape.draft_tokens else form


_INSTR = re.compile(r"^\s+(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
_NOT_BUFFERS = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant"}


def largest_buffers(hlo_text: str, top: int = 6, in_place: bool = False) -> list[dict[str, Any]]:
    """The largest arrays an optimized HLO module materialises (outside fused computations, parameters
    excluded), each with the JAX operation it comes from (a fusion: the first one named inside it, else
    the fusion's own name): what the temp bytes are made of. Sizes, not liveness: XLA reuses memory, so
    they need not add up to the temp bytes."""
    fused_ops: dict[str, str] = {}
    lines, computation = [], ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation's header, or its closing brace
            computation = line.split(" ", 1)[0].lstrip("%") if line.endswith("{") else ""
            continue
        op = re.search(r'op_name="[^"]*?([^/"]+)"', line)
        if computation.startswith(("fused", "wrapped")):
            if op and computation not in fused_ops:
                fused_ops[computation] = op.group(1)
        else:
            lines.append((line, op.group(1) if op else ""))
    found: dict[tuple, dict[str, Any]] = {}
    params = {(m.group(2), math.prod(int(d) for d in m.group(3).split(",") if d))
              for m in map(_INSTR.match, (line for line, _ in lines)) if m and m.group(4) == "parameter"}
    for line, op in lines:
        m = _INSTR.match(line)
        if not m or m.group(4) in _NOT_BUFFERS:
            continue
        if in_place and (m.group(2), math.prod(int(d) for d in m.group(3).split(",") if d)) in params:
            continue  # an update written into its operand (the pool), not a temp
        name, dtype, dims, hlo = m.groups()
        calls = re.search(r"calls=%([\w.-]+)", line)
        op = op or (fused_ops.get(calls.group(1), "") if calls else "") or re.sub(r"\.\d+$", "", name)
        nbytes = math.prod(int(d) for d in dims.split(",") if d) * itemsize(dtype)
        key = (dtype, dims, op)
        found[key] = {"bytes": nbytes, "shape": f"{dtype}[{dims}]", "op": op}
    return sorted(found.values(), key=lambda b: -b["bytes"])[:top]


_COLLECTIVE = re.compile(r"^\s+(?:ROOT )?%\S+ = (.*?) ((?:ragged-)?all-to-all|all-gather|reduce-scatter|all-reduce)"
                         r"(?:-start)?\(")


def collective_buffers(hlo_text: str, top: int = 4) -> list[dict[str, Any]]:
    """The largest results of the collectives in an optimized HLO module (all chunks of a tuple together):
    the buffers that carry rows between devices, e.g. EP's fixed-capacity dispatch."""
    found: dict[tuple, dict[str, Any]] = {}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        arrays = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        nbytes = sum(math.prod(int(d) for d in dims.split(",") if d) * itemsize(t) for t, dims in arrays)
        shape = f"{arrays[0][0]}[{arrays[0][1]}]" + (f" x {len(arrays)}" if len(arrays) > 1 else "")
        found[(m.group(2), shape)] = {"bytes": nbytes, "shape": shape, "op": m.group(2)}
    return sorted(found.values(), key=lambda b: -b["bytes"])[:top]


def _fit(compiled: list[dict[str, Any]], pool_bytes: int, per_token: int, planned_tokens: int,
         memory: float) -> dict[str, Any]:
    """Weights (XLA's arguments less the pool), the pool and the largest step's temp (without XLA:CPU's
    copies of the pool) against the GPU's memory; how many KV tokens per rank that leaves."""
    def temp_of(c: dict[str, Any]) -> int:
        return c["temp_bytes_without_pool_copies_per_device"] + c["generated_code_bytes_per_device"]

    worst = max(compiled, key=temp_of)
    temp, weights = temp_of(worst), worst["argument_bytes_per_device"] - pool_bytes
    tokens = math.floor((memory - weights - temp) / per_token)
    return {"largest_temp_step": f"{worst['kind']} {worst['rows_per_rank']} {worst['gather_mode']}",
            "largest_temp_bytes_per_device": temp, "xla_weight_bytes_per_device": weights,
            "needed_bytes_per_device": weights + pool_bytes + temp, "gpu_memory_bytes": int(memory),
            "fits": weights + pool_bytes + temp <= memory, "kv_tokens_planned_per_rank": planned_tokens,
            "kv_tokens_with_temp_per_rank": max(0, min(planned_tokens, tokens))}


def format_compiled(plan: dict[str, Any]) -> list[str]:
    """The report's lines for the plan's "compiled" and "compile" parts."""
    result = {**plan["compile"], "compiled": plan["compiled"]}
    on_gpu = result.get("target") == "gpu"
    nodes = f" on {result['nodes']} nodes" if result.get("nodes", 1) > 1 else ""
    where = (f"XLA:GPU for {result['host_devices']} simulated {result['device_kind']} (sm_"
             f"{result['target_description']['compute_capability'].replace('.', '')}){nodes}" if on_gpu
             else f"XLA:CPU, {result['host_devices']} host devices")
    out = [f"Compiled by {where}, abstract weights, a pool of {result['num_pages_per_rank']:,} pages x "
           f"{result['page_size']} per rank; attention {result.get('attention_backend', 'xla')}, experts "
           f"{result.get('moe_runner_backend', 'xla')}" + (
               f"; speculative, {result['draft_tokens']} drafts per verify by the MTP layer"
               if result.get("draft_tokens") else "") + "; GiB per device",
           f"  {'step':<24}{'argument':>10}{'output':>9}{'temp':>9}{'temp*':>9}{'code':>7}{'plan w+kv':>11}"
           f"{'arg/plan':>10}{'compile s':>11}"]
    for c in result["compiled"]:
        name = f"{c['kind']} {c['rows_per_rank']} {c['gather_mode']}"
        planned = c["planned_weight_bytes_per_device"] + c["planned_kv_bytes_per_device"]
        out.append(f"  {name:<24}{c['argument_bytes_per_device'] / GiB:10.2f}{c['output_bytes_per_device'] / GiB:9.2f}"
                   f"{c['temp_bytes_per_device'] / GiB:9.2f}{c['temp_bytes_without_pool_copies_per_device'] / GiB:9.2f}"
                   f"{c['generated_code_bytes_per_device'] / GiB:7.2f}"
                   f"{planned / GiB:11.2f}{c['argument_vs_plan'] * 100:+9.2f}%{c['compile_s']:11.1f}")
    out.append("  temp* = temp (XLA:GPU scatters into the pool in place)" if on_gpu else
               "  temp* = temp without XLA:CPU's float32 copies of the pool (the step compiled on a one-page pool)")
    for c in result["compiled"]:
        out.append(f"  largest arrays (temp*) of {c['kind']} {c['rows_per_rank']} {c['gather_mode']}: " + "; ".join(
            f"{b['shape']} {b['bytes'] / GiB:.1f} GiB ({b['op']})"
            for b in c["largest_buffers"]))
        out.append("    collectives' buffers: " + "; ".join(
            f"{b['op']} {b['shape']} {b['bytes'] / GiB:.2f} GiB" for b in c["collective_buffers"]))
    f = result["fit"]
    verdict = "fits" if f["fits"] else "does NOT fit"
    temp = f"{f['largest_temp_step']}: {f['largest_temp_bytes_per_device'] / GiB:.1f} GiB"
    where = "XLA:GPU's" if on_gpu else "docs/plan.md says what differs on a GPU"
    out.append(f"  beside the largest temp* ({temp}; {where}) the planned pool "
               f"{verdict}: {f['needed_bytes_per_device'] / GiB:.1f} of {f['gpu_memory_bytes'] / GiB:.1f} GiB; KV "
               f"tokens per rank: {f['kv_tokens_planned_per_rank']:,} planned, {f['kv_tokens_with_temp_per_rank']:,} "
               "fit beside the temp")
    if on_gpu:
        out += format_gpu(result["compiled"], plan["gpu"])
    return out
