"""What `plan --compile` adds under XLA:GPU: each step's cost against the HBM floor, the checks on its
optimized HLO (`jaxdp.planner.hlo_checks`) with the grids the Pallas kernels should run with, and the
report's lines for them."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from jaxdp.model import mla_prompt
from jaxdp.model.indexer import query_block, selection_size
from jaxdp.model.mla import ONE_ROW_BLOCK
from jaxdp.model.mla_prompt import ABSORBED_BLOCK, KEY_BLOCK
from jaxdp.planner import hlo_checks
from jaxdp.planner.hlo_cost import hlo_cost
from kernels_pallas.fp8_gemm import BLOCK_K, head_tiles
from kernels_pallas.mla_decode import default_num_splits
from kernels_pallas.nvfp4_moe import fit_block

GiB = 2**30
CHECKS = ("fp8_weights", "layer_copies", "kernels", "experts", "collectives")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def step_cost(executable: Any, hlo_text: str, shape: Any, gpu: Any, weight_bytes: int, kv_per_token: int,
              page_size: int) -> dict[str, Any]:
    """One device's FLOPs and bytes accessed (XLA's cost analysis where it answers, else counted from the
    optimized HLO: `jaxdp.planner.hlo_cost`) as a time at the GPU's peaks, beside the HBM floor: every
    weight on the device read once and the KV cache the step attends to read once."""
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    source = "XLA"
    if not cost:
        cost, source = hlo_cost(hlo_checks.parse(hlo_text)), "HLO"
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    # tokens of cache the step's rows can read (a verify's rows read their request's: once a request)
    context = shape.num_requests * shape.pages_per_seq * page_size
    floor_bytes = weight_bytes + context * kv_per_token
    est_s = max(flops / gpu.flops_per_s, accessed / gpu.hbm_bytes_per_s)
    floor_s = floor_bytes / gpu.hbm_bytes_per_s
    return {"source": source, "flops": flops, "bytes_accessed": accessed, "floor_bytes": floor_bytes,
            "estimate_ms": est_s * 1e3, "floor_ms": floor_s * 1e3, "estimate_vs_floor": est_s / floor_s,
            "bound": "compute" if flops / gpu.flops_per_s > accessed / gpu.hbm_bytes_per_s else "memory"}


def step_forms(shape: Any) -> list[Any]:
    """The forms of MLA and the MoE one step runs: itself; a speculative step (`jaxdp.parallel.spec_step`) runs the
    target and the MTP pass over its rows in its own form, then the chained drafts as a decode step of one row per
    request (absorbed, MAX_LEN, the requests' page tables)."""
    if not shape.draft_tokens:
        return [shape]
    r = shape.num_requests
    return [dataclasses.replace(shape, draft_tokens=0),
            dataclasses.replace(shape, absorbed=True, num_rows=r, num_seqs=r, gather_mode="max_len", sum_rows=0,
                                draft_tokens=0)]


def expected_kernels(cfg: Any, layout: Any, shape: Any, page_size: int, expert_dtype: str, moe_backend: str,
                     pallas_attention: bool, redundant: int = 0, dcp: int = 1) -> dict[str, list[tuple[int, int, int]]]:
    """The Pallas kernels the step should hold, with their grids (kernels_pallas' launch rules); a speculative
    step, those of each of its forms (`step_forms`). `redundant`: EP's redundant expert slots (R of E + R);
    `dcp` > 1: attention over a split pool, XLA's partial attention (`jaxdp.parallel.dcp`), no MLA kernel."""
    if shape.draft_tokens:
        merged: dict[str, list[tuple[int, int, int]]] = {}
        for form in step_forms(shape):
            for name, grids in expected_kernels(cfg, layout, form, page_size, expert_dtype, moe_backend,
                                                pallas_attention, redundant, dcp).items():
                merged.setdefault(name, []).extend(grids)
        return merged
    expected: dict[str, list[tuple[int, int, int]]] = {}
    path = prompt_path(cfg, layout, shape, page_size)
    if pallas_attention and dcp == 1 and path in ("decode", "split", "blocked"):
        # a decode step's rows, or a prompt step's one-row sequences, ONE_ROW_BLOCK at a time (`MLA.attend_one_rows`)
        heads = _cdiv(cfg.num_heads // layout.tp, 16)  # block_h 16
        b = shape.num_seqs if shape.absorbed else min(ONE_ROW_BLOCK, shape.num_seqs)
        capacity = shape.pages_per_seq * page_size
        if shape.absorbed and cfg.index_topk and capacity > cfg.index_topk:
            expected["sparse_mla_decode_split"] = [
                (heads, default_num_splits(b, heads, _cdiv(cfg.index_topk, 32)), b)]
        else:
            blocks = _cdiv(capacity, max(page_size, 32))
            expected["mla_decode_split"] = [(heads, default_num_splits(b, heads, blocks), b)]
    if moe_backend == "pallas" and expert_dtype == "nvfp4" and cfg.n_routed_experts:
        experts, inter = moe_shards(cfg, layout, redundant)
        widths = [2 * inter, cfg.hidden_size]
        expected["nvfp4_grouped_matmul"] = [
            (_cdiv(r, 16) + min(experts, r), n // fit_block(64, n), 1)
            for r in moe_rows(cfg, layout, shape) for n in widths]
    expected.update(mla_kv_b_kernels(cfg, layout, shape, page_size, expert_dtype))
    if cfg.hidden_size % 128:  # the GEMMs tile K by 128: such a model multiplies as XLA does
        return expected
    # the layers' Linear weights, read in place by a Pallas GEMM (kernels_pallas.fp8_gemm): block FP8 or plain
    rows = moe_rows(cfg, layout, shape)  # a rank's rows (attention), the gathered ones (dense FFN, shared)
    full = {cfg.q_lora_rank or 0, cfg.num_heads * cfg.qk_head_dim, cfg.kv_cache_dim, cfg.hidden_size,
            2 * cfg.intermediate_size, 2 * cfg.moe_intermediate_size * cfg.n_shared_experts}
    widths = {n // d for n in full if n for d in {1, layout.tp, layout.world} if n % d == 0}
    widths = {n for n in widths if fit_block(64, n) >= 16}  # (kernels_pallas.fp8_gemm.tiles)
    linear = [(_cdiv(r, 64), n // fit_block(64, n), 1) for r in rows for n in widths]
    heads = cfg.num_heads // layout.tp
    kv_b = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    if path not in ("decode", "selected") and cfg.kv_lora_rank % 128 == 0 and fit_block(64, kv_b) >= 16:
        # the prompt's expansion of the latents by kv_b_proj [L, H * (N + V)]: the context's keys at once (B x C,
        # `mla_prompt.attend_dense`), the step's own rows (`attend_split`) and a key block (`attend_blocked`)
        contexts = {"dense": {shape.num_seqs * shape.pages_per_seq * page_size}, "split": {shape.num_rows},
                    "blocked": set()}[path]
        if path != "dense":
            contexts.add(max(1, min(KEY_BLOCK // page_size, shape.pages_per_seq)) * page_size)
        linear += [(_cdiv(r, 64), kv_b // fit_block(64, kv_b), 1) for r in contexts]
    expected["fp8_matmul" if expert_dtype == "fp8" else "stacked_matmul"] = linear
    if cfg.index_topk:  # the DSA indexer's projections (plain weights): the rank's rows, or its blocks of queries
        index_rows = {shape.num_rows, query_block(shape.num_rows, shape.pages_per_seq * page_size,
                                                  cfg.index_head_dim, cfg.index_n_heads)}
        expected.setdefault("stacked_matmul", []).extend(
            (_cdiv(r, 64), n // fit_block(64, n), 1) for r in index_rows
            for n in (cfg.index_n_heads * cfg.index_head_dim, cfg.index_head_dim, cfg.index_n_heads)
            if fit_block(64, n) >= 16)
    if moe_backend == "pallas" and cfg.n_routed_experts and fit_block(64, cfg.n_routed_experts) >= 16:
        e = cfg.n_routed_experts  # the router, float32, in place
        expected.setdefault("stacked_matmul", []).extend((_cdiv(r, 64), e // fit_block(64, e), 1) for r in rows)
        if expert_dtype == "fp8":
            experts, inter = moe_shards(cfg, layout, redundant)
            expected["fp8_grouped_matmul"] = [
                (_cdiv(r, 16) + min(experts, r), n // fit_block(64, n), 1)
                for r in rows for n in (2 * inter, cfg.hidden_size)]
    return expected


def prompt_path(cfg: Any, layout: Any, shape: Any, page_size: int) -> str:
    """Which of MLA's attention forms the step runs (`jaxdp.model.mla.MLA.attend_expanded`): "decode" (absorbed),
    "selected" (a DSA selection), "dense", "split" or "blocked" (`jaxdp.model.mla_prompt`)."""
    capacity = shape.pages_per_seq * page_size
    if shape.absorbed:
        return "decode"
    if selection_size(cfg, capacity):
        return "selected"
    return mla_prompt.prompt_form(shape.num_rows, cfg.num_heads // layout.tp, shape.num_seqs * capacity,
                               cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)


def mla_kv_b_kernels(cfg: Any, layout: Any, shape: Any, page_size: int,
                     expert_dtype: str) -> dict[str, list[tuple[int, int, int]]]:
    """The per-head GEMM of MLA's absorbed products with kv_b_proj [L, H, N + V] (`fp8_head_matmul`): q_nope . W_UK
    (contracting N, L wide out) and W_UV after attention (contracting L, V wide out), with the rows of the
    decode step or of a prompt step's selected attention (DSA), or the prompt's absorbed windows of one or a few
    rows (`mla_prompt.attend_blocked`, also inside `attend_split`) and its one-row sequences in blocks
    (`MLA.attend_one_rows`); none in `attend_dense`."""
    heads, lat = cfg.num_heads // layout.tp, cfg.kv_lora_rank
    products = [n for n, w, c in ((lat, cfg.qk_nope_head_dim, "B"), (cfg.v_head_dim, cfg.v_head_dim, "A"))
                if head_tiles(lat, w, c)]
    path, t = prompt_path(cfg, layout, shape, page_size), shape.num_rows
    if not products or path == "dense":
        return {}
    rows = {t} if path in ("decode", "selected") else {1, min(ABSORBED_BLOCK, t), min(ONE_ROW_BLOCK, shape.num_seqs)}
    grids = [(_cdiv(r, 64), heads, n // min(fit_block(64, n), BLOCK_K)) for r in rows for n in products]
    return {"fp8_head_matmul" if expert_dtype == "fp8" else "stacked_head_matmul": grids}


def moe_shards(cfg: Any, layout: Any, redundant: int = 0) -> tuple[int, int]:
    """(experts, intermediate width) of the routed experts on one device; under EP its expert slots, with
    `redundant` more slots over the devices (`jaxdp.eplb.slots`)."""
    if layout.moe == "ep":
        return (cfg.n_routed_experts + redundant) // layout.world, cfg.moe_intermediate_size
    return cfg.n_routed_experts, cfg.moe_intermediate_size // layout.world


def moe_rows(cfg: Any, layout: Any, shape: Any) -> set[int]:
    """The row counts the routed experts can see on one device: a rank's rows, the gathered rows (MAX_LEN,
    SUM_LEN, every rank's under EP), and each times top-k (the (row, choice) pairs sorted by expert)."""
    t = shape.num_rows
    base = {t, layout.dp * t, layout.world * t, shape.sum_rows or t}
    return base | {r * cfg.num_experts_per_tok for r in base}


def check_step(hlo_text: str, cfg: Any, layout: Any, shape: Any, page_size: int, expert_dtype: str,
               moe_backend: str, pallas_attention: bool, redundant: int = 0,
               dcp: int = 1) -> dict[str, dict[str, Any]]:
    mod = hlo_checks.parse(hlo_text)
    experts, inter = moe_shards(cfg, layout, redundant)
    expected = expected_kernels(cfg, layout, shape, page_size, expert_dtype, moe_backend, pallas_attention,
                                redundant, dcp)
    return {
        "fp8_weights": hlo_checks.check_fp8_weights(mod),
        "layer_copies": hlo_checks.check_layer_copies(mod),
        "kernels": hlo_checks.check_kernels(mod, expected),
        "experts": hlo_checks.check_experts(mod, experts, set().union(*(moe_rows(cfg, layout, f)
                                                                         for f in step_forms(shape))),
                                            {2 * inter, inter, cfg.hidden_size}),
        "collectives": hlo_checks.check_collectives(mod),
    }


def _multipliers(mod: Any) -> dict[str, int]:
    """How many times one step runs each unfused computation: a while loop's body its known trip count times
    (the layer scans), nested loops multiplied."""
    times = {mod.entry: 1}
    todo = [mod.entry]
    while todo:
        comp = todo.pop()
        for ins in mod.computations.get(comp, []):
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.line) if ins.opcode == "while" else None
            for callee in ins.calls():
                if callee in mod.fused or callee in times:
                    continue
                times[callee] = times[comp] * (int(trips.group(1)) if trips else 1)
                todo.append(callee)
    return times


def step_collectives(hlo_text: str) -> list[dict[str, Any]]:
    """Every collective one step runs, from the optimized HLO: op, the buffer on one device (the larger of what
    it sends and what it receives: the gathered result, the reduce-scattered input; the plan's convention),
    its shape, and how many times a step runs it (loop bodies times their trip count), largest total first."""
    mod = hlo_checks.parse(hlo_text)
    times = _multipliers(mod)
    shapes = {c: {i.name: i for i in instrs} for c, instrs in mod.computations.items()}
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    for span in hlo_checks.collective_spans(mod):
        table = shapes[span.computation]
        sent_arrays = [a for n in span.start.operands if n in table for a in table[n].arrays]
        received_arrays = (span.done or span.start).arrays
        if span.done is None and span.start.opcode.endswith("-start"):
            received_arrays = []  # a start without its done: its tuple type holds the operands too
        sent, received = _nbytes(sent_arrays), _nbytes(received_arrays)
        arrays = sent_arrays if sent > received else received_arrays
        shape = ", ".join(f"{t}[{','.join(map(str, d))}]" for t, d in arrays[:2]) + (
            f" (+{len(arrays) - 2})" if len(arrays) > 2 else "")
        key = (span.kind, shape, max(sent, received))
        row = found.setdefault(key, {"op": span.kind, "shape": shape, "bytes": max(sent, received), "count": 0})
        row["count"] += times.get(span.computation, 1)
    return sorted(found.values(), key=lambda r: -r["bytes"] * r["count"])


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(d) * hlo_checks.itemsize(t) for t, d in arrays)


def format_gpu(compiled: list[dict[str, Any]], gpu: dict[str, Any]) -> list[str]:
    """Cost against the floor and the checks, per step."""
    source = ("XLA's cost analysis" if compiled[0]["cost"]["source"] == "XLA" else
              "FLOPs and bytes counted from XLA:GPU's optimized HLO (XLA's cost analysis answers none here)")
    out = [f"{source} per device against the HBM floor ({gpu['name']}: {gpu['hbm_tbs']:g} TB/s, "
           f"{gpu['bf16_tflops']:g} TFLOP/s; the GEMM kernels count one layer of their weights, the MLA kernels "
           "their outputs only)",
           f"  {'step':<24}{'TFLOP':>8}{'GB read':>10}{'estimate ms':>13}{'floor ms':>10}{'x floor':>9}  bound"]
    for c in compiled:
        k = c["cost"]
        name = f"{c['kind']} {c['rows_per_rank']} {c['gather_mode']}"
        out.append(f"  {name:<24}{k['flops'] / 1e12:8.2f}{k['bytes_accessed'] / 1e9:10.1f}{k['estimate_ms']:13.2f}"
                   f"{k['floor_ms']:10.2f}{k['estimate_vs_floor']:9.2f}  {k['bound']}")
    out.append("  floor = every weight on the device and the KV cache the step attends to, each read once")
    for c in compiled:
        out.append(f"  checks of {c['kind']} {c['rows_per_rank']} {c['gather_mode']}:")
        out += [f"    {hlo_checks.summary_line(name, c['checks'][name])}" for name in CHECKS]
        if rows := c.get("collectives"):
            total = sum(r["bytes"] * r["count"] for r in rows)
            out.append(f"  collectives of {c['kind']} {c['rows_per_rank']} {c['gather_mode']} ({total / 2**20:,.1f} "
                       "MiB a step on one device; op shape: buffer x times a step):")
            out += [f"    {r['op']} {r['shape']}: {_size(r['bytes'])} x {r['count']}" for r in rows]
    return out


def _size(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"
