"""`python -m jaxdp.one_batch`: one prompt batch, then greedy decode steps; the tool for checking numbers.

In the shape of SGLang's bench_one_batch: prints compile time, prefill latency and throughput, and the
median decode latency. `--dump-logits FILE.npz` writes, for prompt i in the order given, `prompt_i`
(float32 logits of every prompt position, [len_i, vocab]), `decode_i` (logits of each decode step,
[O, vocab]) and `tokens_i` (the greedy tokens fed to those steps, [O]; tokens_i[0] is the argmax of
the last prompt position). The output format is the same whatever the layout.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import jax
import numpy as np

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.engine.setup import build_runners
from jaxdp.layout import LayoutError, add_layout_args, ensure_host_devices, layout_from_args
from jaxdp.model.checkpoint import CheckpointError
from jaxdp.model.loader import model_config
from jaxdp.ops.platform import keep_freed_host_memory
from jaxdp.ops.registry import ATTENTION_BACKENDS, MOE_RUNNER_BACKENDS, moe_runner_backend
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.planner.measured import describe, machine, step_floor

log = logging.getLogger("jaxdp.one_batch")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def run_prompts(runner: StepRunner, prompts: list[list[int]], ranks: list[int], output_len: int, *,
                gather_mode: str = "auto", timings: dict | None = None) -> dict[str, list[np.ndarray]]:
    """Prefill all prompts in one step (each on its rank), then `output_len` greedy decode steps."""
    dp, S = runner.layout.dp, runner.page_size
    by_rank: list[list[int]] = [[] for _ in range(dp)]
    for i, r in enumerate(ranks):
        if not 0 <= r < dp:
            raise ValueError(f"prompt {i} is placed on rank {r}, but the layout has ranks 0..{dp - 1}")
        by_rank[r].append(i)
    pages: dict[int, list[int]] = {}
    for r in range(dp):
        nxt = 0
        for i in by_rank[r]:
            n = -(-(len(prompts[i]) + output_len) // S)
            pages[i] = list(range(nxt, nxt + n))
            nxt += n
        if nxt > runner.num_pages:
            raise ValueError(f"rank {r} needs {nxt} pages of {S} tokens; the pool has {runner.num_pages}")
    N = max(len(p) for p in pages.values())
    B = _pow2(max(len(b) for b in by_rank))
    rows = [sum(len(prompts[i]) for i in b) for b in by_rank]
    T = _pow2(max(max(rows), 1))
    mode = gather_mode if gather_mode != "auto" else ("sum_len" if T * dp > 2 * sum(rows) + 8 else "max_len")
    sum_rows = -(-max(sum(rows), 1) // 8) * 8
    common = dict(pages_per_seq=N, page_size=S, num_pages=runner.num_pages)

    def step(pieces_by_rank, shape):
        batches = [build_rank_batch(pcs, num_rows=shape.num_rows, num_seqs=shape.num_seqs,
                                    all_logits=shape.all_logits, **common) for pcs in pieces_by_rank]
        return runner.run(shape, stack_ranks(batches)), batches

    shape = StepShape(False, T, B, N, mode, sum_rows if mode == "sum_len" else 0, all_logits=True)
    t0 = time.perf_counter()
    runner.compile(shape)
    t1 = time.perf_counter()
    (logits, _), batches = step([[Piece(prompts[i], 0, pages[i]) for i in b] for b in by_rank], shape)
    logits = np.asarray(jax.device_get(logits), np.float32)
    t2 = time.perf_counter()
    out: dict[str, list[np.ndarray]] = {"prompt": [None] * len(prompts), "decode": [], "tokens": []}
    for r, b in enumerate(by_rank):
        row = 0
        for i in b:
            out["prompt"][i] = logits[r, row:row + len(prompts[i])]
            row += len(prompts[i])
    tokens = {i: [int(out["prompt"][i][-1].argmax())] for i in range(len(prompts))}
    decode = {i: [] for i in range(len(prompts))}
    dshape = StepShape(True, B, B, N)
    t3 = time.perf_counter()
    runner.compile(dshape)
    decode_compile_s = time.perf_counter() - t3
    step_times, copy_times = [], []
    for j in range(output_len):
        pieces = [[Piece([tokens[i][j]], len(prompts[i]) + j, pages[i]) for i in b] for b in by_rank]
        ts = time.perf_counter()
        (logits, _), _ = step(pieces, dshape)
        jax.block_until_ready(logits)  # the step; what follows is this tool's copy of every row's logits
        tc = time.perf_counter()
        logits = np.asarray(jax.device_get(logits), np.float32)
        step_times.append(tc - ts)
        copy_times.append(time.perf_counter() - tc)
        for r, b in enumerate(by_rank):
            for k, i in enumerate(b):
                decode[i].append(logits[r, k])
                if j + 1 < output_len:
                    tokens[i].append(int(logits[r, k].argmax()))
    for i in range(len(prompts)):
        out["decode"].append(np.stack(decode[i]) if decode[i] else np.zeros((0, logits.shape[-1])))
        out["tokens"].append(np.asarray(tokens[i][:output_len], np.int32))
    if timings is not None:
        timings.update(prefill_compile_s=t1 - t0, prefill_s=t2 - t1, decode_compile_s=decode_compile_s,
                       decode_median_s=float(np.median(step_times)) if step_times else 0.0,
                       logits_copy_median_s=float(np.median(copy_times)) if copy_times else 0.0,
                       prefill_tokens=sum(rows), gather_mode=mode, decode_rows=B * dp)
    return out


def print_roofline(runner: StepRunner, prompts: list[list[int]], output_len: int, dtype: str, t: dict) -> None:
    """The prefill and the median decode step against this machine's floor (`jaxdp.planner.measured`), on one
    attention rank's rows (the floor of a one-device step; under a layout, the busiest device's is the planner's)."""
    if runner.layout.world != 1:
        return
    mach = machine()
    fmt = weight_format(runner)
    mean_prompt = round(sum(len(p) for p in prompts) / len(prompts))
    print("prefill " + describe(step_floor(runner.cfg, [mean_prompt] * len(prompts), 0, dtype, mach,
                                           expert_dtype=fmt), t["prefill_s"]))
    if output_len:
        context = mean_prompt + output_len // 2
        print("decode " + describe(step_floor(runner.cfg, [1] * len(prompts), context, dtype, mach,
                                              expert_dtype=fmt), t["decode_median_s"]))


def weight_format(runner: StepRunner) -> str:
    """How the floor prices the weights (`jaxdp.planner.weights`): "nvfp4" experts, "fp8" (DeepSeek's block
    FP8 Linear weights and experts, as held), or "bf16"."""
    if runner.expert_quantization == "nvfp4":
        return "nvfp4"
    return "fp8" if any("float8" in str(x.dtype) for x in jax.tree.leaves(runner.state)) else "bf16"


def parse_prompt_ids(text: str) -> list[list[int]]:
    try:
        prompts = [[int(t) for t in part.split(",") if t.strip()] for part in text.split(";")]
    except ValueError:
        raise ValueError(f"--prompt-ids {text!r} is not a list like \"1,2,3;4,5,6\"") from None
    if any(not p for p in prompts):
        raise ValueError("--prompt-ids has an empty prompt; give at least one token id per prompt")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.one_batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="tiny",
                    help="checkpoint directory or preset (tiny, deepseek-v3, glm-5)")
    ap.add_argument("--num-layers", type=int, help="override the depth of a preset (random weights)")
    ap.add_argument("--width", choices=["preset", "tiny"], default="preset",
                    help="'tiny' keeps a preset's depth and dense/MoE split at the tiny model's width")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--prompt-ids", help='explicit prompts: "1,2,3;4,5,6" (overrides batch size/input len)')
    ap.add_argument("--ranks", help='rank of each prompt, e.g. "0,0,1,3" (default: i mod dp)')
    ap.add_argument("--gather-mode", choices=["auto", "max_len", "sum_len"], default="auto")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                    help="MLA decode: Pallas kernel, jaxdp's native CPU kernel or the XLA path (default: pallas on "
                         "a GPU, native on a CPU where it is built, else xla)")
    ap.add_argument("--moe-runner-backend", choices=MOE_RUNNER_BACKENDS,
                    help="routed experts: xla (lax.ragged_dot), blocked (jaxdp.ops.grouped, not expanded per "
                         "expert), pallas (NVFP4's grouped GEMM, blocked for bf16 and FP8 experts) or auto (few rows "
                         "gather their chosen experts, many run blocked) (default: pallas on a GPU, auto on a CPU; "
                         "pallas on a CPU runs in interpret mode)")
    ap.add_argument("--quantization", choices=["nvfp4", "fp8"],
                    help="nvfp4: hold the routed experts as NVFP4, quantized at load (a ModelOpt NVFP4 or "
                         "jaxdp.quantize checkpoint is NVFP4 without it); fp8: the layers' Linear weights in "
                         "DeepSeek's block FP8 (a block-FP8 checkpoint stays FP8 without it)")
    ap.add_argument("--dump-logits", metavar="FILE.npz")
    add_layout_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)  # "no TPU" noise on CPU hosts
    try:
        layout = layout_from_args(args)
        ensure_host_devices(layout.world)
        layout = layout_from_args(args, num_devices=len(jax.devices()))
        cfg = model_config(args.model_path, args.num_layers, args.width == "tiny")
        if args.prompt_ids:
            prompts = parse_prompt_ids(args.prompt_ids)
        else:
            rng = np.random.default_rng(args.seed)
            n, V = args.batch_size, cfg.vocab_size
            prompts = [rng.integers(0, V, args.input_len).tolist() for _ in range(n)]
        ranks = ([int(r) for r in args.ranks.split(",")] if args.ranks
                 else [i % layout.dp for i in range(len(prompts))])
        if len(ranks) != len(prompts):
            raise ValueError(f"--ranks names {len(ranks)} ranks for {len(prompts)} prompts; "
                             "give one per prompt")
        S = args.page_size
        per_rank = [sum(-(-(len(p) + args.output_len) // S) for p, r in zip(prompts, ranks, strict=True) if r == k)
                    for k in range(layout.dp)]
        keep_freed_host_memory()
        mesh = layout.make_mesh(jax.devices()[: layout.world])
        layout.check_memory(jax.devices()[: layout.world])  # before the KV pool is sized
        t_load = time.perf_counter()
        runner = build_runners(args.model_path, layout, [mesh], dtype=args.dtype, seed=args.seed,
                               quantization=args.quantization, num_pages=max(per_rank) + 1, page_size=S,
                               attention_backend=args.attention_backend, moe_backend=args.moe_runner_backend,
                               num_layers=args.num_layers, tiny_width=args.width == "tiny")[0]
        load_s = time.perf_counter() - t_load
        cfg = runner.cfg
    except (LayoutError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t: dict = {}
    out = run_prompts(runner, prompts, ranks, args.output_len, gather_mode=args.gather_mode, timings=t)
    experts = (f"{runner.expert_quantization} ({moe_runner_backend(args.moe_runner_backend)})"
               if runner.expert_quantization else "dense")
    print(f"model {args.model_path}: {cfg.num_layers} layers ({cfg.num_dense_layers} dense, "
          f"{cfg.num_moe_layers} MoE; experts {experts}), layout {layout.describe()}")
    print(f"load: {load_s:.2f} s")
    print(f"compile: prefill {t['prefill_compile_s']:.2f} s, decode {t['decode_compile_s']:.2f} s")
    print(f"prefill: {t['prefill_tokens']} tokens in {t['prefill_s'] * 1e3:.1f} ms "
          f"({t['prefill_tokens'] / max(t['prefill_s'], 1e-9):.1f} tok/s, gather {t['gather_mode']})")
    if args.output_len:
        print(f"decode: median {t['decode_median_s'] * 1e3:.2f} ms/step until the logits are ready, "
              f"{len(prompts) / max(t['decode_median_s'], 1e-9):.1f} tok/s (this tool's copy of the logits to "
              f"the host, apart: {t['logits_copy_median_s'] * 1e3:.2f} ms)")
    print_roofline(runner, prompts, args.output_len, args.dtype, t)
    acc = runner.last_account
    if acc is not None:
        print(f"last step ({acc.kind}): rows per rank {list(acc.rows)}, gather {acc.gather_mode}, "
              f"{acc.gathered_rows} rows gathered for {acc.exact_rows} needed, {acc.bytes_per_step / 2**10:.1f} KiB "
              f"through collectives; experts compute {acc.experts_jaxdp.ratio:.2f}x the needed rows "
              f"(SGLang: {acc.experts_sglang.ratio:.2f}x)")
    if args.dump_logits:
        arrays = {}
        for i in range(len(prompts)):
            arrays[f"prompt_{i}"] = out["prompt"][i]
            arrays[f"decode_{i}"] = out["decode"][i]
            arrays[f"tokens_{i}"] = out["tokens"][i]
        np.savez(args.dump_logits, **arrays)
        print(f"wrote {args.dump_logits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
