"""`python -m jaxdp.plan`: capacity, communication and padding of a layout, for real model sizes.

    python -m jaxdp.plan --model glm-5 --gpus 4 --gpu B300 --mesh dp=4 --expert-dtype nvfp4 \\
        --kv-dtype fp8 --match-tp-tokens 2.68M

prints, for the layout and beside it tensor parallelism on the same GPUs: weights per device by
component, KV bytes per token and KV capacity, the five situations of the article (or --rows) from
jaxdp.parallel.accounting, and a roofline of one decode step. --json writes the same as JSON, --plot
draws the situations, --compile also compiles the engine's largest steps for the model on abstract
weights and sets XLA's memory analysis beside the plan (jaxdp.planner.compile). The rules behind every
figure are in docs/plan.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import jax

from jaxdp.config import UnsupportedConfigError, get_config
from jaxdp.layout import Layout, LayoutError, add_layout_args, check_redundant_experts, layout_from_args
from jaxdp.ops.registry import ATTENTION_BACKENDS, MOE_RUNNER_BACKENDS
from jaxdp.parallel.accounting import EXTEND, Situation, account_step, five_situations
from jaxdp.planner.compile import CompileCase, compile_plan, format_compiled
from jaxdp.planner.dcp import DCPError, check_dcp, dcp_summary
from jaxdp.planner.gpus import PRESETS as GPU_PRESETS
from jaxdp.planner.gpus import GPUError, get_gpu, parse_memory, with_overrides
from jaxdp.planner.report import ASSUMPTIONS, PlotError, format_report, plot_situations
from jaxdp.planner.roofline import decode_roofline
from jaxdp.planner.weights import (
    EXPERT_DTYPES,
    KV_DTYPES,
    PLACEMENTS,
    handoff,
    kv_bytes,
    kv_tokens,
    total_bytes,
    weights_per_device,
)
from jaxdp.planner.xla_target import COMPILE_TARGETS, TargetError, default_target

GiB = 2**30


class PlanError(ValueError):
    """A user error; the message is one sentence. `plan`: what was computed before it (--json still writes it)."""

    plan: dict[str, Any] | None = None


def _layout(args: argparse.Namespace) -> Layout:
    if args.mesh is None and getattr(args, "tp_size", None) is None:
        raise PlanError("give the layout with --mesh dp=A,tp=B (or a preset) or with --tp-size N "
                        "[--attn-dp-size A].")
    return layout_from_args(args, num_devices=args.gpus)


def _parse_count(text: str) -> float:
    t = text.strip().upper()
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(t[-1:], 1.0)
    try:
        return float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise PlanError(f"{text!r} is not a token count; write e.g. 2.68M or 2680000.") from None


def _parse_rows(text: str, dp: int) -> tuple[int, ...]:
    try:
        rows = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"--rows {text!r} is not a list of whole numbers; write e.g. 16,16,16,16.") from None
    if len(rows) != dp or any(r < 0 for r in rows) or not any(rows):
        raise PlanError(f"--rows needs {dp} non-negative counts (one per attention group), not all zero; "
                        f"got {text!r}.")
    return rows


def _merge(s: Situation, dp: int) -> Situation:
    """The same load on `dp` groups: consecutive ranks' rows summed (dp=1 is tensor parallelism)."""
    k = len(s.rows) // dp

    def m(v: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sum(v[i * k:(i + 1) * k]) for i in range(dp))

    return Situation(s.name, m(s.rows), s.kind, m(s.lm_rows) if s.lm_rows else None)


def plan_layout(cfg: Any, layout: Layout, gpu: Any, args: argparse.Namespace, budget: float,
                situations: dict[str, Situation], batch: tuple[int, ...], dcp: int = 1) -> dict[str, Any]:
    spec = args.speculative_algorithm is not None  # the MTP layer and its draft KV on every device too
    eplb = _eplb(layout, args)
    comps = weights_per_device(cfg, layout, args.expert_dtype, include_mtp=spec, **_placement(args),
                               num_redundant_experts=eplb["num_redundant_experts"])
    wbytes = total_bytes(comps)
    per_token = kv_bytes(cfg, args.kv_dtype, include_mtp=spec).per_token
    tokens = kv_tokens(budget, wbytes, per_token)
    accts = {name: account_step(layout, cfg, s.rows, is_extend=s.kind == EXTEND, lm_rows=s.lm_rows)
             for name, s in situations.items()}
    roof_kw = dict(context=args.context, expert_dtype=args.expert_dtype, kv_dtype=args.kv_dtype,
                   latency_us=args.latency_us, **_placement(args), **eplb)
    single = (1,) + (0,) * (layout.dp - 1)
    group_tokens = max(tokens, 0) * dcp  # (--dcp-size: each device of a group holds 1/dcp of every sequence)
    return {
        "layout": dataclasses.asdict(layout), "describe": _describe(layout),
        "weights": [dataclasses.asdict(c) for c in comps], "weights_per_device_gib": wbytes / GiB,
        "kv_tokens_per_rank": group_tokens, "kv_tokens_total": group_tokens * layout.dp * layout.replicas,
        "dcp": dcp_summary(cfg, layout.tp, dcp, max(tokens, 0), max(batch)) if dcp > 1 else None,
        "fits": tokens > 0,
        "situations": {name: a.to_dict() for name, a in accts.items()},
        "roofline": {
            "single": {p: decode_roofline(cfg, layout, gpu, single, padding=p, **roof_kw).to_dict()
                       for p in ("sglang", "jaxdp")},
            "batch": {p: decode_roofline(cfg, layout, gpu, batch, padding=p, **roof_kw).to_dict()
                      for p in ("sglang", "jaxdp")},
        },
    }


def _fitting_layout(cfg: Any, gpus: int, budget: float, args: argparse.Namespace) -> str:
    """The advice that ends a does-not-fit error: the first layout on the same GPUs or 2, 4, ... times as
    many, up to 64 (most attention DP first, TP before EP MoE), whose weights leave room for a KV cache."""
    counts = [gpus << k for k in range(7) if (gpus << k) <= max(64, gpus)]
    for n in counts:
        for tp in (t for t in range(1, n + 1) if n % t == 0):
            for moe in ("tp", "ep"):
                lay = Layout(dp=n // tp, tp=tp, moe=moe)
                try:
                    lay.validate(num_devices=n, n_routed_experts=cfg.n_routed_experts, num_heads=cfg.num_heads)
                except (LayoutError, ValueError):
                    continue
                need = total_bytes(weights_per_device(cfg, lay, args.expert_dtype, **_placement(args),
                                                      include_mtp=args.speculative_algorithm is not None))
                if need < budget:
                    mesh = f"dp={lay.dp},tp={lay.tp}" + (",moe=ep" if moe == "ep" else "")
                    return f"a layout that fits: --gpus {n} --mesh {mesh} ({need / GiB:.1f} GiB of weights per GPU)."
    return f"no layout on up to {counts[-1]} GPUs holds it; use --expert-dtype fp8 or nvfp4, or larger GPUs."


def _eplb(layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    """The redundant experts and the balancedness a layout is priced with: the flags' under moe=ep; none under
    moe=tp (the TP comparison), where every device computes a slice of every expert."""
    if layout.moe != "ep":
        return {"num_redundant_experts": 0, "balancedness": 1.0}
    return {"num_redundant_experts": args.ep_num_redundant_experts, "balancedness": args.balancedness}


def _placement(args: argparse.Namespace) -> dict[str, Any]:
    return {"placement": args.placement, "absorbed_copy": False if args.no_absorbed_copy else None}


def _describe(layout: Layout) -> str:
    return layout.describe()


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    try:
        cfg = get_config(args.model)
    except (FileNotFoundError, UnsupportedConfigError) as e:
        raise PlanError(str(e)) from None
    gpu = get_gpu(args.gpu)
    gpu = with_overrides(gpu, parse_memory(args.gpu_memory) if args.gpu_memory else None,
                         args.hbm_tbs, args.tflops, args.link_gbs)
    layout = _layout(args)
    if layout.total_devices != args.gpus:
        raise PlanError(f"the layout uses {layout.total_devices} GPUs but --gpus is {args.gpus}; make them "
                        "equal.")
    layout.validate(num_devices=args.gpus, n_routed_experts=cfg.n_routed_experts, num_heads=cfg.num_heads)
    check_redundant_experts(layout, cfg.n_routed_experts, args.ep_num_redundant_experts)
    try:
        check_dcp(args.dcp_size, layout.tp)
    except DCPError as e:
        raise PlanError(str(e)) from None
    if args.dcp_size > 1 and args.compile and args.speculative_algorithm is not None:
        raise PlanError(f"--compile compiles the engine's step, which does not speculate over a split KV pool "
                        f"yet; drop --dcp-size {args.dcp_size} or --speculative-algorithm.")
    if not 0 < args.balancedness <= 1:
        raise PlanError(f"--balancedness {args.balancedness} is mean / max tokens a GPU; give a value in (0, 1].")
    if args.balancedness != 1 and layout.moe != "ep":
        raise PlanError(f"--balancedness prices the most loaded GPU under expert parallelism, but the MoE is "
                        f"moe={layout.moe}; add moe=ep to --mesh or drop the flag.")
    draft_tokens = _draft_tokens(cfg, args)
    spec = draft_tokens > 0
    tp_layout = Layout(dp=1, tp=layout.total_devices)
    per_token = kv_bytes(cfg, args.kv_dtype, include_mtp=spec).per_token
    tp_weights = total_bytes(weights_per_device(cfg, tp_layout, args.expert_dtype, include_mtp=spec,
                                                **_placement(args)))
    if args.match_tp_tokens:
        budget = tp_weights + _parse_count(args.match_tp_tokens) * per_token
        fraction = budget / gpu.memory_bytes
        if fraction > 1:
            raise PlanError(f"{args.match_tp_tokens} tokens under TP need {budget / GiB:.1f} GiB per GPU, "
                            f"more than the {gpu.memory_gib:g} GiB of a {gpu.name}; ask for fewer tokens.")
    else:
        fraction = args.mem_fraction_static
        if not 0 < fraction <= 1:
            raise PlanError(f"--mem-fraction-static {fraction} must be in (0, 1]; SGLang's are 0.8-0.9.")
        budget = fraction * gpu.memory_bytes

    if args.rows:
        rows = _parse_rows(args.rows, layout.dp)
        kind = EXTEND if args.extend else "decode"
        lm_rows = tuple(1 if r else 0 for r in rows) if args.extend else None  # one sequence per rank
        situations = {"rows": Situation("rows", rows, kind, lm_rows)}
        batch = rows
    else:
        base = five_situations(layout.dp if layout.dp > 1 else layout.world)
        situations = {k: _merge(v, 1) for k, v in base.items()} if layout.dp == 1 else base
        batch = situations["balanced"].rows
    main_plan = plan_layout(cfg, layout, gpu, args, budget, situations, batch, dcp=args.dcp_size)
    if not main_plan["fits"]:
        need = main_plan["weights_per_device_gib"]
        raise PlanError(f"the weights need {need:.1f} GiB per GPU but {budget / GiB:.1f} GiB are available "
                        f"({fraction:.2f} x {gpu.memory_gib:g} GiB of a {gpu.name}); "
                        + _fitting_layout(cfg, layout.total_devices, budget, args))
    compare = None
    if layout.dp > 1:
        tp_situations = {k: _merge(s, 1) for k, s in situations.items()}
        compare = plan_layout(cfg, tp_layout, gpu, args, budget, tp_situations, (sum(batch),))
    plan = {
        "model": args.model, "gpus": args.gpus, "gpu": dataclasses.asdict(gpu),
        "mem_fraction_static": fraction, "budget_gib": budget / GiB,
        "expert_dtype": args.expert_dtype, "kv_dtype": args.kv_dtype,
        "placement": args.placement, **_eplb(layout, args),
        "absorbed_copy": not args.no_absorbed_copy and args.placement == "sglang",
        "context": args.context, "latency_us": args.latency_us,
        "row_bytes": cfg.hidden_size * 2,
        "kv_bytes": dataclasses.asdict(kv_bytes(cfg, args.kv_dtype, include_mtp=spec)),
        "kv_bytes_per_token": per_token,
        "handoff": {"link_gbs": args.handoff_gbs,
                    "prompts": handoff(per_token, tuple(_parse_prompts(args.handoff_prompts)), args.handoff_gbs)},
        "config": {"num_layers": cfg.num_layers, "hidden": cfg.hidden_size,
                                                    "vocab": cfg.vocab_size, "model_type": cfg.model_type},
        "plan": main_plan, "tp": compare,
        "assumptions": [a.replace("the MTP (next-token) layer is not loaded", "the MTP (next-token) layer and its "
                                  "draft KV are counted (speculative decoding)") if spec else a for a in ASSUMPTIONS],
        "speculative": {"algorithm": args.speculative_algorithm.upper(), "num_steps": draft_tokens,
                        "num_draft_tokens": draft_tokens + 1} if spec else None,
    }
    if args.compile:
        kinds = tuple(args.compile_steps.split(","))
        if not kinds or set(kinds) - {"decode", "extend"}:
            raise PlanError(f"--compile-steps {args.compile_steps!r} must be decode, extend or decode,extend.")
        case = CompileCase(args.decode_rows, args.extend_rows, args.context, args.page_size, kinds,
                           args.moe_runner_backend, args.compile_target or default_target(), args.attention_backend,
                           draft_tokens, args.dcp_size)
        result = compile_plan(cfg, layout, plan, case, gpu)
        plan["compiled"] = result.pop("compiled")
        plan["compile"] = result
        _check_temp_fits(cfg, layout, gpu, plan, args)
    return plan


def _check_temp_fits(cfg: Any, layout: Layout, gpu: Any, plan: dict[str, Any], args: argparse.Namespace) -> None:
    """Under XLA:GPU, the weights and the largest step's temp must leave room for a KV cache on the GPU
    (XLA:CPU's temps are not a GPU's: there the report only shows them)."""
    fit = plan["compile"]["fit"]
    weights, temp = fit["xla_weight_bytes_per_device"], fit["largest_temp_bytes_per_device"]
    if plan["compile"]["target"] != "gpu" or weights + temp < gpu.memory_bytes:
        return
    rows = "--decode-rows" if fit["largest_temp_step"].startswith(("decode", "spec-decode")) else "--extend-rows"
    other = _fitting_layout(cfg, layout.total_devices, gpu.memory_bytes - temp, args)
    error = PlanError(f"under {layout.describe()} the weights ({weights / GiB:.2f} GiB) and XLA:GPU's temp of the "
                      f"{fit['largest_temp_step']} step ({temp / GiB:.2f} GiB) need {(weights + temp) / GiB:.2f} "
                      f"GiB per GPU, more than the {gpu.memory_bytes / GiB:.2f} GiB of a {gpu.name}, leaving no "
                      f"room for a KV cache; use fewer {rows}"
                      + (f", or {other}" if other.startswith("a layout") else ", or larger GPUs."))
    error.plan = plan
    raise error


def _draft_tokens(cfg: Any, args: argparse.Namespace) -> int:
    """Drafts per verify under speculative decoding (SGLang's --speculative-num-steps; 0: not speculating). The
    draft model is the checkpoint's MTP layer: a model without one is refused."""
    if args.speculative_algorithm is None:
        if args.speculative_num_steps is not None:
            raise PlanError("--speculative-num-steps needs --speculative-algorithm (EAGLE or NEXTN).")
        return 0
    steps = 3 if args.speculative_num_steps is None else args.speculative_num_steps  # SGLang's DeepSeek default
    if steps < 1:
        raise PlanError(f"--speculative-num-steps {steps} must be at least 1.")
    if not cfg.num_nextn_predict_layers:
        raise PlanError(f"--speculative-algorithm {args.speculative_algorithm.upper()} drafts with the model's MTP "
                        f"(NextN) layer, and {args.model} has none (num_nextn_predict_layers is 0); plan without "
                        "speculative decoding, or use a checkpoint that ships its MTP layer.")
    return steps


def _parse_prompts(text: str) -> list[int]:
    try:
        prompts = [int(x) for x in text.split(",")]
    except ValueError:
        prompts = []
    if not prompts or min(prompts) <= 0:
        raise PlanError(f"--handoff-prompts {text!r} must be prompt lengths in tokens, e.g. 1024,8192.")
    return prompts


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        self.exit(2, f"plan: error: {message}; see python -m jaxdp.plan --help.\n")


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxdp.plan", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="glm-5", help="preset (glm-5, deepseek-v3, kimi-k2, tiny) or checkpoint dir")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the deployment")
    add_layout_args(p)
    p.add_argument("--gpu", default="B300",
                   help=f"{', '.join(GPU_PRESETS)} or name:mem_gib:hbm_tbs:bf16_tflops[:link_gbs]")
    p.add_argument("--gpu-memory", help="memory per GPU, e.g. 269GiB (overrides the preset)")
    p.add_argument("--hbm-tbs", type=float, help="HBM bandwidth, TB/s (overrides the preset)")
    p.add_argument("--tflops", type=float, help="dense bf16 TFLOP/s (overrides the preset)")
    p.add_argument("--link-gbs", type=float, help="GPU-to-GPU GB/s per direction (overrides the preset)")
    p.add_argument("--mem-fraction-static", type=float, default=0.88,
                   help="share of GPU memory for weights + KV cache (SGLang's flag)")
    p.add_argument("--match-tp-tokens",
                   help="instead: the budget at which TP holds this many tokens per GPU, e.g. 2.68M")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    p.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="bf16")
    p.add_argument("--placement", choices=PLACEMENTS, default="sglang",
                   help="whose placement rules: SGLang's (explains the article) or jaxdp's sharding table")
    p.add_argument("--no-absorbed-copy", action="store_true",
                   help="do not count SGLang's w_kc/w_vc copies of kv_b_proj")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0, metavar="R",
                   help="moe=ep: R redundant expert slots (SGLang's flag): their memory per GPU, and --compile "
                        "holds them")
    p.add_argument("--balancedness", type=float, default=1.0,
                   help="moe=ep: mean / max tokens a GPU's experts receive; the step is priced by the most loaded "
                        "GPU (default 1.0: even)")
    p.add_argument("--dcp-size", type=int, default=1, metavar="N",
                   help="decode context parallelism (SGLang's flag): each attention group's KV split token-wise "
                        "over N of its devices (N divides tp); counted by jaxdp/planner/dcp.py; --compile compiles it")
    p.add_argument("--rows", help="rows per attention group, e.g. 16,16,16,16 (default: the five situations)")
    p.add_argument("--extend", action="store_true", help="--rows is a prompt step (default: decode)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per request (roofline)")
    p.add_argument("--latency-us", type=float, default=10.0, help="fixed cost of one collective (roofline)")
    p.add_argument("--compile", action="store_true",
                   help="also compile the engine's largest steps with XLA on abstract weights and compare its "
                        "memory analysis per device with the plan (creates the layout's host devices)")
    p.add_argument("--decode-rows", type=int, default=512, help="--compile: decode bucket, rows per rank")
    p.add_argument("--extend-rows", type=int, default=4096, help="--compile: extend bucket, rows per rank")
    p.add_argument("--page-size", type=int, default=16, help="--compile: tokens per KV page")
    p.add_argument("--compile-steps", default="decode,extend", help="--compile: which steps (decode, extend)")
    p.add_argument("--compile-target", choices=COMPILE_TARGETS,
                   help="--compile: XLA:GPU for --gpu (a shipped target description, simulated devices; the "
                        "default when the CUDA plugin is installed) or XLA:CPU on host devices")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   help="--compile: decode attention, as the server's flag (default: the target's, pallas on a GPU)")
    p.add_argument("--moe-runner-backend", choices=MOE_RUNNER_BACKENDS,
                   help="--compile: the routed experts' grouped matmul, as the server's flag (default: the "
                        "target's: auto on a CPU, which is the blocked form at full size; pallas on a GPU)")
    p.add_argument("--speculative-algorithm", type=str.upper, choices=("EAGLE", "NEXTN"),
                   help="speculative decoding with the model's MTP layer (SGLang's flag): the plan counts the MTP "
                        "layer's weights and draft KV, --compile compiles the speculative steps (verify and draft)")
    p.add_argument("--speculative-num-steps", type=int,
                   help="drafts per verify (SGLang's flag; default 3, its DeepSeek default)")
    p.add_argument("--handoff-gbs", type=float, default=50.0,
                   help="prefill/decode disaggregation: GB/s between a prefill and a decode rank for the KV "
                        "hand-off (default 50: one 400 Gb/s NIC per GPU)")
    p.add_argument("--handoff-prompts", default="1024,8192", help="prompt lengths whose hand-off the plan prices")
    p.add_argument("--json", help="write the plan as JSON to this file")
    p.add_argument("--plot", help="draw the situations to this PNG file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.compile and (args.compile_target or default_target()) == "gpu":
        # XLA:GPU compiles for simulated devices from JAX's CPU backend: without this JAX would look for a
        # CUDA driver first (and the plugin fail to start where there is none); before JAX starts only (JAX read
        # the environment when it was imported, so its config, not JAX_PLATFORMS, is what can still change)
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
    try:
        if min(args.gpus, args.context, args.decode_rows, args.extend_rows, args.page_size) < 1:
            raise PlanError("--gpus, --context, --decode-rows, --extend-rows and --page-size must be positive.")
        plan = build_plan(args)
    except (PlanError, LayoutError, GPUError, TargetError, ValueError) as e:
        print(f"plan: error: {e}", file=sys.stderr)
        if getattr(e, "plan", None) and args.json:  # the compiled figures behind the error, for the record
            with open(args.json, "w") as f:
                json.dump(e.plan, f, indent=1)
        return 2
    print(format_report(plan))
    if "compiled" in plan:
        print("\n".join(["", *format_compiled(plan)]))
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plan, f, indent=1)
        if args.plot:
            plot_situations(plan, args.plot)
    except OSError as e:
        print(f"plan: error: cannot write {e.filename}: {e.strerror}.", file=sys.stderr)
        return 2
    except PlotError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
