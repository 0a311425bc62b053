"""`python -m jaxdp.bench.sparse`: decode step time against context length, dense MLA against DSA.

A random model (default: the `glm-5-tiny` preset) runs one compiled decode step over `--batch`
sequences of each context length, once as is (DeepSeek sparse attention: the indexer reads every
index key, attention reads `index_topk` latents) and once built without its indexer (dense MLA reads
every latent). The pool holds random values; each figure is the median of `--repeats` steps after one
warm-up, the two models' steps taking turns. Prints a table and writes JSON. Attention is the part that
changes; the rest of the step (MoE, LM head) is the same in both columns.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.batch import Piece, build_rank_batch, stack_ranks
from jaxdp.layout import Layout
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.loader import load_model
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


def side_by_side(runs: list, repeats: int) -> list[float]:
    """Median seconds of each step, the steps taking turns (so a busy machine slows all of them alike)."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.sparse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="glm-5-tiny", help="a preset with index_topk (random weights)")
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768,65536")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                    help="float32 by default: XLA:CPU runs bfloat16 dots slowly, which hides the memory-bound part")
    ap.add_argument("--json", default="bench_sparse.json", metavar="FILE")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if any(c % args.page_size for c in contexts):
        ap.error(f"every --contexts value must be a multiple of --page-size {args.page_size}")
    cfg, sparse = load_model(args.model, args.dtype)
    if not cfg.index_topk:
        ap.error(f"--model {args.model} has no sparse attention (index_topk); use glm-5-tiny")
    # the same model without its indexer (other random weights: they do not change the time)
    dense = DeepseekV3(cfg.with_(index_topk=None, indexer_types=None), nnx.Rngs(0), jnp.dtype(args.dtype))
    rows = []
    print(f"decode step, {args.batch} sequence(s), {args.model} ({cfg.num_layers} layers, index_topk "
          f"{cfg.index_topk}), {args.dtype}, {jax.devices()[0].platform}")
    print(f"{'context':>8} {'dense ms':>9} {'sparse ms':>10} {'dense/sparse':>13}")
    for c in contexts:
        runners, runs = zip(decode_step(dense, c, args.batch, args.page_size),
                            decode_step(sparse, c, args.batch, args.page_size), strict=True)
        d, s = side_by_side(list(runs), args.repeats)
        for r in runners:
            r.close()
        rows.append({"context": c, "dense_ms": d * 1e3, "sparse_ms": s * 1e3})
        print(f"{c:>8} {d * 1e3:>9.2f} {s * 1e3:>10.2f} {d / s:>13.2f}")
    report = {"model": args.model, "batch": args.batch, "dtype": args.dtype, "index_topk": cfg.index_topk,
              "machine": f"{platform.machine()} {jax.devices()[0].device_kind}", "results": rows}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
