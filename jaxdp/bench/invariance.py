"""`python -m jaxdp.bench.invariance`: where a row's result depends on the rows beside it (docs/determinism.md).

Two parts, both in-process on this machine's CPU devices (no server):

- `--ops` (the default): each operation of the default model's step applied to T rows, T from 1 to 256, and row
  0 (or every row) compared bit for bit with the same row computed in another T: XLA:CPU's dots of the router's
  and the sliced experts' shapes, its row reductions (an RMSNorm's mean, log_softmax, a segment_sum of a row's
  expert results), exp element by element, jaxdp's native products, and the forms that replace them
  (`jaxdp.ops.rows`, the native kernels).
- `--engine MESH [MESH ...]`: one greedy probe through `jaxdp.Engine` with the default model, in six companies
  (alone on rank 0, after a prefix-cache hit, alone on rank 1, among 3, 15 and 31 other prompts on ranks 0, 3
  and 5), with and without `--deterministic` (the server's --enable-deterministic-inference): the distinct
  (token ids, logprobs) sets per layout, then for each pair of layouts whether the probe's answers agree bit for
  bit. A layout may carry its engine's settings after "@": `dp=8@chunk=64,overlap=0` (the chunked-prefill size of all
  ranks together; the overlap schedule off), so one run also compares chunkings and the overlap. `--output FILE`
  writes the answers as JSON.

    python -m jaxdp.bench.invariance --ops
    python -m jaxdp.bench.invariance --engine dp=8 tp=8 dp=8,moe=ep dp=2,tp=4 --deterministic
    python -m jaxdp.bench.invariance --engine dp=8 dp=8@chunk=64 dp=8@overlap=0 --deterministic
"""

from __future__ import annotations

import argparse
import json
import string
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp import native
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.model.layers import rms_norm
from jaxdp.ops.rows import log_softmax, row_sum

ROWS = (1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 256)
COMPANIES = [("alone, rank 0", 0, 0, False), ("cached, rank 0", 0, 0, True), ("alone, rank 1", 0, 1, True),
             ("among 3, rank 0", 3, 0, True), ("among 15, rank 3", 15, 3, True), ("among 31, rank 5", 31, 5, True)]


def op_table() -> list[tuple[str, list[int] | str]]:
    """(operation, the row counts T at which the first T rows differ from the same rows computed at T = 256; for
    exp, a sentence)."""
    rng = np.random.default_rng(0)

    def differs(f, *shapes) -> list[int]:
        xs = [jnp.asarray(rng.standard_normal((256, *s)), jnp.float32) for s in shapes]
        full = np.asarray(jax.jit(f)(*xs))
        return [T for T in ROWS if not np.array_equal(np.asarray(jax.jit(f)(*(x[:T] for x in xs))), full[:T])]

    def weight(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    router, experts, head, w64 = weight(256, 8), weight(256, 512), weight(1, 64, 8, 32), weight(64)
    pairs = lambda y: jax.ops.segment_sum(y, jnp.arange(y.shape[0]) // 2, num_segments=y.shape[0] // 2)  # noqa: E731
    table = [
        ("XLA dot [T, 256] x [256, 8] (the router)", differs(lambda x: x @ router, (256,))),
        ("XLA dot [T, 256] x [256, 512]", differs(lambda x: x @ experts, (256,))),
        ("XLA mean of squares [T, 64] (the RMSNorm before)", differs(
            lambda x: jnp.mean(x * x, -1), (64,))),
        ("XLA log_softmax [T, 512] (the sampler before)", differs(lambda x: jax.nn.log_softmax(x, -1), (512,))),
        ("XLA segment_sum of row pairs [T, 256] (the MoE's combine before)", differs(pairs, (256,))),
        ("rows.row_sum / rms_norm [T, 64] (now)", differs(lambda x: rms_norm(x, w64, 1e-6), (64,))),
        ("rows.log_softmax [T, 512] (now)", differs(log_softmax, (512,))),
        ("rows.row_sum [T, 256] (now)", differs(lambda x: row_sum(x), (256,))),
    ]
    if native.available():
        table += [
            ("native dense [T, 256] x [256, 8] (the router now)", differs(lambda x: native.dense_matmul(x, router),
                                                                          (256,))),
            ("native W_UK per head [T, 8, 16] (now)", differs(lambda x: native.head_matmul(x, head, 0, 0, 16, "B"),
                                                              (8, 16))),
        ]
    v = rng.standard_normal(300).astype(np.float32) * 3
    total = sum(2 * n for n in range(1, 80))
    for name, f in (("exp", jnp.exp), ("sigmoid", jax.nn.sigmoid), ("silu", jax.nn.silu), ("cos", jnp.cos),
                    ("rsqrt", lambda x: jax.lax.rsqrt(jnp.abs(x) + 1))):
        seen, moved, run = {}, 0, jax.jit(f)
        for n in range(1, 80):
            for x in (v[:n], v[3:3 + n]):
                for a, b in zip(x, np.asarray(run(x)), strict=True):
                    moved += seen.setdefault(a.tobytes(), b.tobytes()) != b.tobytes()
        table.append((f"XLA {name} of one value at other places of arrays of 1 to 79 values",
                      f"{moved} of {total} results differ from the value's first"))
    return table


def probe_answers(mesh: str, deterministic: bool, temperature: float = 0.0, seed: int | None = None,
                  overlap: bool = True, chunk: int = 512) -> dict[str, list]:
    """The probe's [ids, logprobs as float.hex, cached tokens] in each of COMPANIES."""
    cfg = EngineConfig(page_size=16, num_pages=64, max_running_requests=64, chunked_prefill_size=chunk,
                       disable_cuda_graph=True, overlap=overlap)
    eng = Engine("default", mesh, cfg, warmup=False, deterministic=deterministic)
    rng = np.random.default_rng(0)

    def enc(text: str) -> list[int]:
        e = eng.tokenizer.encode(text)
        return e if isinstance(e, list) else e.ids

    def letters(n: int) -> str:
        return "".join(rng.choice(list(string.ascii_lowercase), size=n))

    probe = enc(f"reverse {letters(40)}=")
    others = [enc(f"reverse {letters(int(rng.integers(16, 49)))}=" if i % 2 else
                  f"{int(rng.integers(1, 99))}+{int(rng.integers(1, 99))}=") for i in range(31)]
    sp = SamplingParams(max_new_tokens=24, temperature=temperature, seed=seed, return_logprob=True)
    dp, out = eng.runner.layout.dp, {}
    try:
        for name, n, rank, flush in COMPANIES:
            r = eng.generate(others[:n] + [probe], sp, ranks=[None] * n + [rank % dp])[-1]
            out[name] = [list(r.output_ids), [float(x).hex() for x in r.output_logprobs], r.cached_tokens]
            if flush:
                eng.flush_cache()
    finally:
        eng.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.invariance", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", action="store_true", help="the operations' table (the default)")
    ap.add_argument("--engine", nargs="+", metavar="MESH", help="the probe through an engine on each layout")
    ap.add_argument("--deterministic", action="store_true", help="the engines with --enable-deterministic-inference")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None, help="the probe's sampling seed (with --temperature > 0)")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--chunked-prefill-size", type=int, default=512, help="all ranks together (as the server's)")
    ap.add_argument("--output", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if not args.engine:
        for name, rows in op_table():
            said = rows if isinstance(rows, str) else (
                "differs at T = " + ", ".join(map(str, rows)) if rows else "invariant")
            print(f"{name:72s} {said}")
        return 0
    answers = {}
    for mesh in args.engine:
        try:
            layout, _, settings = mesh.partition("@")
            kv = dict(s.split("=", 1) for s in settings.split(",") if s)
            if set(kv) - {"chunk", "overlap"}:
                raise ValueError(f"settings after '@' are chunk=N and overlap=0|1, got {settings!r}")
            answers[mesh] = probe_answers(layout, args.deterministic, args.temperature, args.seed,
                                          kv.get("overlap", "0" if args.disable_overlap_schedule else "1") != "0",
                                          int(kv.get("chunk", args.chunked_prefill_size)))
        except ValueError as e:
            print(f"error: {mesh}: {e}", file=sys.stderr)
            return 2
        sets = {json.dumps(a[:2]) for a in answers[mesh].values()}
        ids = {json.dumps(a[0]) for a in answers[mesh].values()}
        print(f"{mesh}: {len(ids)} token-id set(s), {len(sets)} (token ids + logprobs) set(s) in "
              f"{len(COMPANIES)} companies", flush=True)
    meshes = list(answers)
    for i, a in enumerate(meshes):
        for b in meshes[i + 1:]:
            x, y = answers[a]["alone, rank 0"], answers[b]["alone, rank 0"]
            gap = max(abs(float.fromhex(p) - float.fromhex(q)) for p, q in zip(x[1], y[1], strict=False))
            print(f"{a} vs {b}: token ids {'equal' if x[0] == y[0] else 'differ'}, logprobs "
                  f"{'bit-identical' if x[1] == y[1] else f'differ (largest gap {gap:.3g})'}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"deterministic": args.deterministic, "answers": answers}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
