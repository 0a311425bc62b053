"""`python -m jaxdp.bench.stack_slices`: what reading a layer's weights out of a layer stack costs on XLA:CPU.

    python -m jaxdp.bench.stack_slices [--rows 1,32] [--reps 20]

XLA:CPU hands a product whole buffers: a weight sliced out of a stack `[layers, ...]` (the layer scan's
`dynamic-slice`, or a static slice once the scan is unrolled) is copied before the product reads it, unless the
slice fuses into a gather or an elementwise fusion. This measures, on toys of the issue-26 checkpoint's widths
(7 layers; hidden 1024):

- dense weights (three products a layer, [1024, 2048], [2048, 1024], [1024, 1024]): `lax.scan` over the stacks
  (the model's form), the same scan unrolled (static slices), and per-layer arrays (no slice at all);
- the blocked routed experts (32 experts of width 256, top-4, `jaxdp.ops.grouped.grouped_matmul`): the layer's
  experts sliced out of the stack by the scan, then each block's expert out of that copy (the form before), and
  each block slicing its expert out of the whole stack (`grouped_matmul(layer=...)`, the form now).

Prints the fastest and the median of `--reps` calls (ms) and the floor (the weights the rows need, at the
machine's read bandwidth of `jaxdp.bench.roofline`).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.bench.profile import timings
from jaxdp.ops.grouped import grouped_matmul
from jaxdp.ops.platform import keep_freed_host_memory
from jaxdp.planner.measured import machine

L, D, F, E, I, TOPK = 7, 1024, 2048, 32, 256, 4


def _timed(fn, *args, reps: int) -> tuple[float, float]:
    """The fastest and the median of `reps` calls, in ms."""
    times = timings(fn, *args, reps=reps)
    return float(np.min(times)) * 1e3, float(np.median(times)) * 1e3


def _dense_layer(x, w1, w2, w3):
    return x + (jax.nn.silu(x @ w1) @ w2) @ w3


def dense_variants() -> dict:
    def scan(x, ws, unroll=1):
        return jax.lax.scan(lambda x, w: (_dense_layer(x, *w), None), x, ws, unroll=unroll)[0]

    def per_layer(x, per):
        for w in per:
            x = _dense_layer(x, *w)
        return x

    return {"scan over stacks": jax.jit(scan),
            "scan unrolled (static slices)": jax.jit(lambda x, ws: scan(x, ws, True)),
            "per-layer arrays": jax.jit(per_layer)}


def expert_variants() -> dict:
    def moe(x, e_LTK, w1, w2, in_place: bool):
        def body(x, xs):
            e_TK, i = xs[-2:]
            order = jnp.argsort(e_TK.reshape(-1), stable=True)
            sizes = jnp.bincount(e_TK.reshape(-1), length=E).astype(jnp.int32)
            rows = order // TOPK
            if in_place:
                a, b, kw = w1, w2, {"layer": i}
            else:
                a, b, kw = xs[0], xs[1], {}
            h = grouped_matmul(x[rows], a, sizes, **kw)
            h = jax.nn.silu(h[:, :I]) * h[:, I:]
            y = grouped_matmul(h, b, sizes, **kw)
            return x + jax.ops.segment_sum(y, rows, num_segments=x.shape[0]) * 0.01, None

        xs = (e_LTK, jnp.arange(L)) if in_place else (w1, w2, e_LTK, jnp.arange(L))
        return jax.lax.scan(body, x, xs)[0]

    return {"experts: layer sliced, then each block's expert": jax.jit(lambda *a: moe(*a, False)),
            "experts: each block's expert read from the stack": jax.jit(lambda *a: moe(*a, True))}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.stack_slices", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--reps", type=int, default=20)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    keep_freed_host_memory()
    bw = machine().read_bytes_per_s
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (L, a, b), jnp.float32) * 0.02
          for i, (a, b) in enumerate([(D, F), (F, D), (D, D)])]
    per = [[w[i] for w in ws] for i in range(L)]
    w1 = jax.random.normal(jax.random.fold_in(key, 7), (L, E, D, 2 * I), jnp.float32) * 0.02
    w2 = jax.random.normal(jax.random.fold_in(key, 8), (L, E, I, D), jnp.float32) * 0.02
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("| variant | rows | fastest ms | median ms | floor ms |\n|---|---|---|---|---|")
    for T in [int(r) for r in args.rows.split(",")]:
        x = jnp.full((T, D), 0.1, jnp.float32)
        floor = L * sum(w[0].size for w in ws) * 4 / bw * 1e3
        for name, fn in dense_variants().items():
            fast, med = _timed(fn, x, per if name.startswith("per") else ws, reps=args.reps)
            print(f"| {name} | {T} | {fast:.2f} | {med:.2f} | {floor:.2f} |", flush=True)
        e = np.argsort(np.random.default_rng(0).random((L, T, E)), -1)[..., :TOPK]
        used = np.mean([len(np.unique(layer)) for layer in e])
        floor = L * used * 3 * D * I * 4 / bw * 1e3
        results = []
        for name, fn in expert_variants().items():
            results.append(np.asarray(fn(x, jnp.asarray(e, jnp.int32), w1, w2)))
            fast, med = _timed(fn, x, jnp.asarray(e, jnp.int32), w1, w2, reps=args.reps)
            print(f"| {name} | {T} | {fast:.2f} | {med:.2f} | {floor:.2f} |", flush=True)
        np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
