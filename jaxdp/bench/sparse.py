"""`python -m jaxdp.bench.sparse`: decode step time against context length, dense MLA against DSA.

A random model (default: the `glm-5-tiny` preset) runs one compiled decode step over `--batch`
sequences of each context length, once as is (DeepSeek sparse attention: the indexer reads every
index key, attention reads `index_topk` latents) and once built without its indexer (dense MLA reads
every latent). A third build splits the DSA step: every layer "shared", so no indexer runs and attention
reads `index_topk` latents of the selection the step starts from ("given"; the same positions in every
layer); DSA minus given is the indexer's part (index-key gather, scores, top-k on the full layers). The
pool holds random values; each figure is the median of `--repeats` steps after one warm-up, the models'
steps taking turns. Prints a table and writes JSON; the indexer's slope is a least-squares fit of its
part against context over the contexts past `index_topk`. Attention is the part that changes; the rest
of the step (MoE, LM head) is the same in every column.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.layout import Layout
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.indexer import Indexer
from jaxdp.model.loader import load_model
from jaxdp.model.mla import gather_context
from jaxdp.parallel.step import StepRunner, StepShape


def decode_step(model, context: int, batch: int, page_size: int):
    """A compiled decode step of `batch` sequences of `context` tokens on one device, over a random pool:
    returns a function that runs it once and waits for its logits."""
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    layout = Layout()
    runner = StepRunner(model, layout, layout.make_mesh(jax.devices()[:1]), num_pages=num_pages,
                        page_size=page_size)
    keys = jax.random.split(jax.random.key(0), len(runner.cache))
    runner.cache = {name: jax.random.normal(k, c.shape, c.dtype)
                    for k, (name, c) in zip(keys, runner.cache.items(), strict=True)}
    pieces = [Piece([7], context - 1, list(range(b * pages_per_seq, (b + 1) * pages_per_seq)))
              for b in range(batch)]
    shape = StepShape(True, batch, batch, pages_per_seq)
    stacked = stack_ranks([build_rank_batch(pieces, num_rows=batch, num_seqs=batch, pages_per_seq=pages_per_seq,
                                            page_size=page_size, num_pages=num_pages)])
    runner.compile(shape)

    def run() -> None:
        runner.run(shape, stacked)[0].block_until_ready()

    run()  # warm-up
    return runner, run


def indexer_parts(cfg, context: int, page_size: int, dtype, repeats: int) -> dict[str, float]:
    """Median ms of one full layer's indexer over `context` tokens for one decode query, its parts run
    apart (each its own jitted call): the page-table gather of the index keys, the scores, the top-k."""
    indexer = Indexer(cfg, nnx.Rngs(0), dtype)
    k = jax.random.split(jax.random.key(1), 4)
    num_pages = context // page_size
    keys_PSE = jax.random.normal(k[0], (num_pages, page_size, cfg.index_head_dim), dtype)
    table_BN = jnp.arange(num_pages, dtype=jnp.int32)[None]
    q_TQ = jax.random.normal(k[1], (1, cfg.q_lora_rank), dtype)
    x_TD = jax.random.normal(k[2], (1, cfg.hidden_size), dtype)
    pos_T = jnp.array([context - 1], jnp.int32)
    keys_BCE = gather_context(keys_PSE, table_BN)
    score_TC = jax.random.normal(k[3], (1, context), jnp.float32)
    calls = {
        "gather": (jax.jit(gather_context), keys_PSE, table_BN),
        "scores": (jax.jit(indexer.scores), q_TQ, x_TD, pos_T, keys_BCE),
        "top_k": (jax.jit(lambda s: jax.lax.top_k(s, cfg.index_topk)[1]), score_TC),
    }
    runs = [lambda f=f, a=a: jax.block_until_ready(f(*a)) for f, *a in calls.values()]
    for run in runs:
        run()
    return {name: t * 1e3 for name, t in zip(calls, side_by_side(runs, repeats), strict=True)}


def side_by_side(runs: list, repeats: int) -> list[float]:
    """Median seconds of each step, the steps taking turns (so a busy machine slows all of them alike)."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.sparse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="glm-5-tiny", help="a preset with index_topk (random weights)")
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                    help="float32 by default: XLA:CPU runs bfloat16 dots slowly, which hides the memory-bound part")
    ap.add_argument("--json", default="bench_sparse.json", metavar="FILE")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(c % args.page_size for c in contexts):
        ap.error(f"every --contexts value must be a multiple of --page-size {args.page_size}")
    cfg, sparse = load_model(args.model, args.dtype)
    if not cfg.index_topk:
        ap.error(f"--model {args.model} has no sparse attention (index_topk); use glm-5-tiny")
    # the same model without its indexer, and with its indexer never run (other random weights: they do
    # not change the time)
    dense = DeepseekV3(cfg.with_(index_topk=None, indexer_types=None), nnx.Rngs(0), jnp.dtype(args.dtype))
    given = DeepseekV3(cfg.with_(indexer_types=("shared",) * cfg.num_layers), nnx.Rngs(0), jnp.dtype(args.dtype))
    rows = []
    print(f"decode step, {args.batch} sequence(s), {args.model} ({cfg.num_layers} layers, "
          f"{sum(cfg.indexer_full)} with an indexer, index_topk {cfg.index_topk}), {args.dtype}, "
          f"{jax.devices()[0].platform}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'context':>8} {'dense ms':>9} {'DSA ms':>7} {'given ms':>9} {'indexer ms':>11} {'dense/DSA':>10}")
    for c in contexts:
        runners, runs = zip(*(decode_step(m, c, args.batch, args.page_size) for m in (dense, sparse, given)),
                            strict=True)
        d, s, g = side_by_side(list(runs), args.repeats)
        for r in runners:
            r.close()
        rows.append({"context": c, "dense_ms": d * 1e3, "sparse_ms": s * 1e3, "given_ms": g * 1e3,
                     "indexer_ms": (s - g) * 1e3, "load_average": os.getloadavg()[0]})
        print(f"{c:>8} {d * 1e3:>9.2f} {s * 1e3:>7.2f} {g * 1e3:>9.2f} {(s - g) * 1e3:>11.2f} {d / s:>10.2f}")
    past = [r for r in rows if r["context"] > cfg.index_topk]
    slopes = {}
    if len(past) >= 2:
        x = np.array([r["context"] for r in past]) / 1024
        slopes = {f"{k}_ms_per_1k": float(np.polyfit(x, [r[f"{k}_ms"] for r in past], 1)[0])
                  for k in ("dense", "sparse", "given", "indexer")}
        print("past index_topk, ms per 1k tokens of context: "
              + ", ".join(f"{k.removesuffix('_ms_per_1k')} {v:.3f}" for k, v in slopes.items()))
    parts = indexer_parts(cfg, contexts[-1], args.page_size, jnp.dtype(args.dtype), args.repeats)
    print(f"one full layer's indexer at {contexts[-1]} tokens, parts apart (ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    report = {"model": args.model, "batch": args.batch, "dtype": args.dtype, "index_topk": cfg.index_topk,
              "machine": f"{platform.machine()} {jax.devices()[0].device_kind}", "results": rows, "slopes": slopes,
              "indexer_parts_ms": {"context": contexts[-1], **parts}}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
