"""Kernel bench: Pallas kernels beside the XLA path (their jnp references, jitted) in the same run.

    python -m kernels_pallas.bench [--quick | --preset full|quick|tiny] [--json out.json] [--markdown out.md]

MLA decode: per DP-attention rank all heads (GLM-5: H=64, DeepSeek-V3: H=128), C=512, R=64, bf16 cache in
64-token pages, every row at the same context length. Grouped NVFP4 GEMM: 256 experts, top-8 routing of
`tokens` tokens (rows = 8 x tokens, uniform random experts), gate/up [E, 2I, H] and down [E, H, I] with
GLM-5 (H=6144, I=2048) and DeepSeek-V3 (H=7168, I=2048) dims. Bytes are what the op must move at least
(cache rows or the touched experts' 4.5-bit weights, plus activations); both paths are charged the same
bytes and FLOPs, so their GB/s compare directly. Peaks default to an H200 (4.8 TB/s, 989 bf16 TFLOP/s).
`quick` and `tiny` divide the model dimensions so the CPU (interpret mode) can smoke-test the script; their
timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.mla_decode import default_interpret, mla_decode, mla_decode_reference
from kernels_pallas.nvfp4_moe import nvfp4_grouped_matmul, nvfp4_grouped_matmul_reference

MODELS = {
    "glm5": dict(heads=64, hidden=6144, moe_inter=2048),
    "dsv3": dict(heads=128, hidden=7168, moe_inter=2048),
}
PRESETS = {
    "full": dict(models=("glm5", "dsv3"), shrink={}, latent=512, rope=64, page_size=64,
                 batches=(1, 8, 64, 256), contexts=(1024, 8192, 32768), tokens=(1, 8, 64, 512),
                 experts=256, top_k=8, iters=20),
    "quick": dict(models=("glm5", "dsv3"), shrink=dict(heads=4, hidden=16, moe_inter=16), latent=512,
                  rope=64, page_size=64, batches=(1, 4), contexts=(256,), tokens=(1, 8), experts=8,
                  top_k=2, iters=3),
    "tiny": dict(models=("glm5",), shrink=dict(heads=4, hidden=48, moe_inter=32), latent=64, rope=16,
                 page_size=16, batches=(2,), contexts=(64,), tokens=(4,), experts=4, top_k=2, iters=2),
}


def time_call(fn, args, iters: int):
    """Median wall time in seconds of fn(*args) after one warm-up (compile) call, and its output."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _key(seed: int) -> jax.Array:
    return jax.random.key(seed, impl="unsafe_rbg")  # cheap to compile, fine for bench data


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6, 7))
def _mla_args(key, batch, heads, c, r, page_size, pages_per_row, context):
    """Queries, cache, shuffled page table and lengths for one case, made on the device in one call."""
    keys = jax.random.split(key, 4)
    return (
        jax.random.normal(keys[0], (batch, heads, c), jnp.bfloat16),
        jax.random.normal(keys[1], (batch, heads, r), jnp.bfloat16),
        jax.random.normal(keys[2], (batch * pages_per_row, page_size, c + r), jnp.bfloat16),
        jax.random.permutation(keys[3], batch * pages_per_row).astype(jnp.int32).reshape(batch, -1),
        jnp.full((batch,), context, jnp.int32),
    )


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _gemm_args(key, rows, experts, n, k):
    """Activations and random NVFP4 expert weights (any byte is a valid pair of E2M1 codes)."""
    keys = jax.random.split(key, 4)
    return (
        jax.random.normal(keys[0], (rows, k), jnp.bfloat16),
        jax.random.bits(keys[1], (experts, n, k // 2), jnp.uint8),
        jax.random.uniform(keys[2], (experts, n, k // 16), minval=0.5, maxval=2.0).astype(jnp.float8_e4m3fn),
        jax.random.uniform(keys[3], (experts,), minval=1e-3, maxval=2e-3),
    )


def mla_cases(preset, model):
    heads, c, r, page_size = model["heads"], preset["latent"], preset["rope"], preset["page_size"]
    for batch in preset["batches"]:
        for context in preset["contexts"]:
            pages_per_row = math.ceil(context / page_size)
            key = _key(batch * 7919 + context)
            args = _mla_args(key, batch, heads, c, r, page_size, pages_per_row, context)
            bytes_moved = 2 * (batch * context * (c + r) + batch * heads * (2 * c + r))
            flops = 2 * batch * heads * context * (2 * c + r)
            yield dict(kernel="mla_decode", batch=batch, context=context), args, bytes_moved, flops


def gemm_cases(preset, model):
    experts, top_k, hidden, inter = preset["experts"], preset["top_k"], model["hidden"], model["moe_inter"]
    rng = np.random.default_rng(0)
    for tokens in preset["tokens"]:
        chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]  # distinct experts per token
        sizes_E = np.bincount(chosen.ravel(), minlength=experts).astype(np.int32)
        rows, touched = tokens * top_k, int(np.count_nonzero(sizes_E))
        for kernel, n, k in (("nvfp4_gate_up", 2 * inter, hidden), ("nvfp4_down", hidden, inter)):
            args = (*_gemm_args(_key(tokens * 31 + n), rows, experts, n, k), jnp.asarray(sizes_E))
            bytes_moved = touched * n * (k // 2 + k // 16) + 2 * rows * (k + n)
            yield dict(kernel=kernel, batch=tokens, context=rows), args, bytes_moved, 2 * rows * n * k


def run(preset_name: str, peak_gbs: float, peak_tflops: float, iters: int | None,
        kernels: tuple[str, ...] = ("mla", "nvfp4")):
    preset = PRESETS[preset_name]
    iters = iters or preset["iters"]
    interpret = default_interpret()
    results = []
    for name in preset["models"]:
        model = {dim: size // preset["shrink"].get(dim, 1) for dim, size in MODELS[name].items()}
        label = name if not preset["shrink"] else f"{name}-{preset_name}"
        scale = 1.0 / math.sqrt(192)  # qk_nope 128 + rope 64
        mla_kw = dict(softmax_scale=scale, kv_lora_rank=preset["latent"])
        mla_paths = {
            "pallas": jax.jit(functools.partial(mla_decode, **mla_kw, interpret=interpret)),
            "xla": jax.jit(functools.partial(mla_decode_reference, **mla_kw)),
        }
        gemm_paths = {
            "pallas": jax.jit(functools.partial(nvfp4_grouped_matmul, interpret=interpret)),
            "xla": jax.jit(functools.partial(nvfp4_grouped_matmul_reference, compute_dtype=jnp.bfloat16)),
        }
        families = {"mla": (mla_cases, mla_paths), "nvfp4": (gemm_cases, gemm_paths)}
        for cases, paths in ((families[f][0](preset, model), families[f][1]) for f in kernels):
            for case, args, bytes_moved, flops in cases:
                outputs = {}
                for path, fn in paths.items():
                    row = dict(case, model=label, heads=model["heads"], path=path, bytes=bytes_moved,
                               flops=flops, error=None)
                    try:  # one failing case (a compile error, out of memory) must not end a GPU run
                        seconds, outputs[path] = time_call(fn, args, iters)
                    except Exception as e:
                        seconds, row["error"] = math.nan, f"{type(e).__name__}: {str(e)[:300]}"
                    gbs, tflops = bytes_moved / seconds / 1e9, flops / seconds / 1e12
                    results.append(dict(row, time_us=seconds * 1e6, gbs=gbs, tflops=tflops,
                                        frac_peak_bw=gbs / peak_gbs, frac_peak_flops=tflops / peak_tflops))
                diff = math.nan
                if len(outputs) == 2:
                    diff = float(np.max(np.abs(np.asarray(outputs["pallas"], np.float32)
                                               - np.asarray(outputs["xla"], np.float32))))
                for row in results[-len(paths):]:
                    row["max_abs_diff"] = diff
                    print_row(row)
                del args, outputs
    return results


HEADER = ("kernel", "model", "batch", "ctx/rows", "path", "time_us", "GB/s", "TFLOP/s", "%BW", "%FLOP",
          "max_abs_diff")


def _cells(r):
    return (r["kernel"], r["model"], str(r["batch"]), str(r["context"]), r["path"], f"{r['time_us']:.1f}",
            f"{r['gbs']:.1f}", f"{r['tflops']:.2f}", f"{100 * r['frac_peak_bw']:.1f}",
            f"{100 * r['frac_peak_flops']:.1f}", f"{r['max_abs_diff']:.2e}")


def print_row(r):
    print(" ".join(f"{cell:>14}" for cell in _cells(r)), flush=True)
    if r["error"]:
        print(f"    {r['path']} failed: {r['error']}", flush=True)


def markdown(report) -> str:
    lines = [
        f"Command: `{report['command']}`  ",
        f"Machine: {report['device']} ({report['backend']}, interpret={report['interpret']}), "
        f"jax {report['jax_version']}, {report['date']}  ",
        f"Peaks for the % columns: {report['peak_gbs']:.0f} GB/s, {report['peak_tflops']:.0f} TFLOP/s",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in report["results"]]
    failures = [r for r in report["results"] if r["error"]]
    if failures:
        lines += ["", "Failures:", ""]
        lines += [f"- {r['kernel']} {r['model']} {r['batch']}/{r['context']} {r['path']}: "
                  f"`{r['error'].splitlines()[0]}`" for r in failures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m kernels_pallas.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--quick", action="store_const", const="quick", dest="preset",
                        help="small shapes (the CPU smoke run); same as --preset quick")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write a docs-ready markdown table here")
    parser.add_argument("--iters", type=int, help="timed calls per case (median reported)")
    parser.add_argument("--kernels", default="mla,nvfp4",
                        help="which kernels, comma-separated: mla (decode attention), nvfp4 (grouped GEMM)")
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="device memory bandwidth, GB/s")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="device bf16 dense TFLOP/s")
    args = parser.parse_args(argv)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if not kernels or set(kernels) - {"mla", "nvfp4"}:
        parser.error(f"--kernels takes mla and/or nvfp4, got {args.kernels!r}")

    device = jax.devices()[0]
    print(f"# {device.device_kind} ({jax.default_backend()}), interpret={default_interpret()}, "
          f"preset={args.preset}")
    print(" ".join(f"{h:>14}" for h in HEADER), flush=True)
    results = run(args.preset, args.peak_gbs, args.peak_tflops, args.iters, kernels)
    report = dict(
        command="python -m kernels_pallas.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        device=device.device_kind, backend=jax.default_backend(), interpret=default_interpret(),
        jax_version=jax.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        preset=args.preset, peak_gbs=args.peak_gbs, peak_tflops=args.peak_tflops, results=results,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report))
    return report


if __name__ == "__main__":
    main()
