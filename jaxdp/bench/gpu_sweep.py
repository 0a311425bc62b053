"""Stage (c) of `python -m jaxdp.bench.gpu`: every op's backends (`jaxdp.ops.registry.OPS`) and the tile
configurations its Pallas kernel takes, each timed beside the op's xla backend on the same operands.

    python -m jaxdp.bench.gpu_sweep --jsonl OUT.jsonl --until EPOCH_S [--rehearse] [--previous RUN.json]

Most informative first: the backends of every op at its first shape (the shapes the issue's goals name: MLA
decode at batch 64 over 8k tokens, the grouped expert GEMM at one token), then at its other shapes, then the tile
configurations of each Pallas kernel: its defaults, the last run's winner (`--previous`, a `gpu.json` this
command wrote), then one parameter changed at a time. Each backend runs through the op layer's own function
(`jaxdp.ops.attention`, `gemm`, `experts`), each tile configuration through the kernel (`kernels_pallas`) with
those block sizes. Every timing is a median over `--iters` calls after a warm-up, with the largest difference
from the xla backend's result; each is one JSON line appended to `--jsonl` as soon as it is measured, and
nothing starts after `--until` (seconds since the epoch). A backend that cannot run here (`registry.runs_here`) is
not timed; an op with a single backend has nothing to choose and is not swept.

`--rehearse` (the CPU rehearsal, interpret mode) runs the same code at tiny shapes; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.model.fp8 import scale_shape
from jaxdp.ops import attention, experts
from jaxdp.ops.gemm import projection
from jaxdp.ops.registry import OPS, platform_of, runs_here
from jaxdp.ops.stacked import StackedWeight
from kernels_pallas.bench import time_call
from kernels_pallas.fp8_gemm import fp8_grouped_matmul, fp8_matmul
from kernels_pallas.nvfp4_moe import nvfp4_grouped_matmul

FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A Pallas kernel's tile parameters: their defaults and the values the sweep tries."""

    name: str
    defaults: dict
    choices: dict


KERNELS = {  # op -> its Pallas kernel's tiles (the keyword arguments the kernel takes)
    "mla_decode": Kernel("kernels_pallas.mla_decode.mla_decode",
                         dict(block_h=16, block_t=None, num_splits=None, num_warps=4, num_stages=2),
                         dict(block_h=(32, 64), block_t=(64, 128), num_splits=(1, 4, 16), num_warps=(8,),
                              num_stages=(1, 3))),
    "sparse_mla_decode": Kernel("kernels_pallas.sparse_mla_decode.sparse_mla_decode",
                                dict(block_h=16, block_t=32, num_splits=None, num_warps=4, num_stages=2),
                                dict(block_h=(32, 64), block_t=(64, 128), num_splits=(1, 4, 16), num_warps=(8,),
                                     num_stages=(1, 3))),
    "projection_gemm": Kernel("kernels_pallas.fp8_gemm.fp8_matmul",
                              dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
                              dict(block_m=(16, 32, 128), block_n=(32, 128, 256), num_warps=(8,), num_stages=(2, 4))),
    "expert_gemm": Kernel("kernels_pallas.fp8_gemm.fp8_grouped_matmul",
                          dict(block_m=16, block_n=64, num_warps=4, num_stages=3),
                          dict(block_m=(32, 64), block_n=(32, 128, 256), num_warps=(8,), num_stages=(2, 4))),
    "expert_gemm_nvfp4": Kernel("kernels_pallas.nvfp4_moe.nvfp4_grouped_matmul",
                                dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3),
                                dict(block_m=(32, 64), block_n=(32, 128, 256), block_k=(256,), num_warps=(8,),
                                     num_stages=(2, 4))),
}
TILED_OP = {"expert_gemm_nvfp4": "expert_gemm"}  # a kernel swept for tiles under another op's name


@dataclasses.dataclass
class Case:
    """One shape of one op: `make()` builds its operands on the device; `backends` maps each backend to a function
    of them (the op layer's); `tiled(**tiles)` the Pallas kernel with those tiles (None: no tile sweep); bytes and
    FLOPs the op must move and do at least."""

    op: str
    label: str
    make: Callable[[], tuple]
    backends: dict[str, Callable]
    tiled: Callable | None
    bytes: float
    flops: float
    kernel: str | None = None  # the KERNELS entry `tiled` sweeps (default: the op's)


def _key(seed: int) -> jax.Array:
    return jax.random.key(seed, impl="unsafe_rbg")


def mla_case(label: str, batch: int, heads: int, context: int, c: int, r: int, page: int, topk: int = 0) -> Case:
    """MLA's absorbed decode (dense, or with `topk`: the sparse decode over that many selected tokens)."""
    pages = -(-context // page)
    scale = 1.0 / math.sqrt(192)
    kw = dict(softmax_scale=scale, kv_lora_rank=c)

    @jax.jit
    def make_dense():
        k = jax.random.split(_key(batch * 7 + context), 4)
        return (jax.random.normal(k[0], (batch, heads, c), jnp.bfloat16),
                jax.random.normal(k[1], (batch, heads, r), jnp.bfloat16),
                jax.random.normal(k[2], (batch * pages, page, c + r), jnp.bfloat16),
                jax.random.permutation(k[3], batch * pages).astype(jnp.int32).reshape(batch, pages),
                jnp.full((batch,), context, jnp.int32))

    if not topk:
        dense = attention.KERNELS
        backends = {b: jax.jit(functools.partial(dense[b][0], **kw)) for b in OPS["mla_decode"].backends}
        tiled = lambda **t: jax.jit(functools.partial(attention.mla_decode_pallas, **kw, **t))  # noqa: E731
        moved = 2 * (batch * context * (c + r) + batch * heads * (2 * c + r))
        return Case("mla_decode", label, make_dense, backends, tiled, moved, 2 * batch * heads * context * (2 * c + r))

    def make_sparse():
        q_l, q_r, kv, _, _ = make_dense()
        slots = jax.random.randint(_key(topk), (batch, topk), 0, batch * pages * page, jnp.int32)
        return q_l, q_r, kv, slots, jnp.full((batch,), topk, jnp.int32)

    sparse = {"xla": attention.sparse_mla_decode_xla, "pallas": attention.sparse_mla_decode_pallas}
    backends = {b: jax.jit(functools.partial(f, **kw)) for b, f in sparse.items()}
    tiled = lambda **t: jax.jit(functools.partial(attention.sparse_mla_decode_pallas, **kw, **t))  # noqa: E731
    moved = 2 * (batch * topk * (c + r) + batch * heads * (2 * c + r))
    return Case("sparse_mla_decode", label, make_sparse, backends, tiled, moved, 2 * batch * heads * topk * (2 * c + r))


def _fp8_stack(key, shape, scales) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(key)
    w = (jax.random.normal(k1, shape, jnp.float32) * 0.5).astype(FP8)
    return w, jax.random.uniform(k2, scales, jnp.float32, 0.5e-2, 2e-2)


def projection_case(label: str, m: int, k: int, n: int) -> Case:
    """A block-FP8 Linear weight [K, N] (one layer of a stack of 2) times x [M, K], bf16 out."""

    @jax.jit
    def make():
        kx, kw = jax.random.split(_key(m * 13 + n))
        w, s = _fp8_stack(kw, (2, k, n), (2, k // 128, n // 128))
        return jax.random.normal(kx, (m, k), jnp.bfloat16), w, s

    def op(backend):
        def run(x, w, s):
            weight = StackedWeight(w, s, jnp.int32(1), 128, jnp.bfloat16)
            return projection("td,dq->tq", x, weight, lambda eq, x, w: jnp.einsum(
                eq, x, w, preferred_element_type=jnp.float32), backend=backend)
        return jax.jit(run)

    def tiled(**tiles):
        def run(x, w, s):
            v, sc, cols = StackedWeight(w, s, jnp.int32(1), 128, jnp.bfloat16).gemm_operands(1)
            return fp8_matmul(x, v, sc, cols, 1, out_dtype=jnp.bfloat16, **tiles)
        return jax.jit(run)

    return Case("projection_gemm", label, make, {b: op(b) for b in OPS["projection_gemm"].backends}, tiled,
                k * n + k * n / 128**2 * 4 + 2 * m * (k + n), 2 * m * k * n)


def _routing(tokens: int, num_experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(tokens)
    idx = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)
    return idx, np.full((tokens, top_k), 1.0 / top_k, np.float32)


def expert_case(label: str, tokens: int, num_experts: int, top_k: int, d: int, i: int) -> Case:
    """The routed experts' SwiGLU in block FP8 (DeepSeek-V3's format): gate_up [E, D, 2, I], down [E, I, D]."""
    idx, weights = _routing(tokens, num_experts, top_k)
    touched = len(np.unique(idx))

    @jax.jit
    def make():
        k = jax.random.split(_key(tokens * 17 + num_experts), 3)
        up = _fp8_stack(k[1], (1, num_experts, d, 2, i), scale_shape("w_gate_up_ED2I", (1, num_experts, d, 2, i), 128))
        down = _fp8_stack(k[2], (1, num_experts, i, d), scale_shape("w_down_EID", (1, num_experts, i, d), 128))
        return jax.random.normal(k[0], (tokens, d), jnp.bfloat16), *up, *down

    def weights_of(w1, s1, w2, s2):
        layer = jnp.int32(0)
        return (StackedWeight(w1, s1, layer, 128, jnp.bfloat16), StackedWeight(w2, s2, layer, 128, jnp.bfloat16))

    def op(backend):
        def run(x, w1, s1, w2, s2):
            return experts.routed_experts(x, jnp.asarray(idx), jnp.asarray(weights), *weights_of(w1, s1, w2, s2),
                                          backend=backend)[0]
        return jax.jit(run)

    def tiled(**tiles):  # the gate_up product of the rows sorted by expert, as `routed_experts_fp8` runs it
        order = np.argsort(idx.reshape(-1), kind="stable")
        sizes = np.bincount(idx.reshape(-1), minlength=num_experts).astype(np.int32)

        def run(x, w1, s1, w2, s2):
            v, sc, cols = weights_of(w1, s1, w2, s2)[0].gemm_operands(1, lead=1)
            return fp8_grouped_matmul(x[order // top_k], v, sc, cols, jnp.asarray(sizes), 0, **tiles)
        return jax.jit(run)

    moved = touched * 3 * d * i * (1 + 4 / 128**2) + 2 * tokens * d * 2
    return Case("expert_gemm", label, make, {b: op(b) for b in OPS["expert_gemm"].backends}, tiled, moved,
                2 * 3 * tokens * top_k * d * i)


def nvfp4_expert_case(label: str, tokens: int, num_experts: int, top_k: int, d: int, i: int) -> Case:
    """The routed experts' SwiGLU in NVFP4 (GLM-5's and ModelOpt's checkpoints); tiles of the NVFP4 grouped GEMM."""
    idx, weights = _routing(tokens, num_experts, top_k)
    touched = len(np.unique(idx))

    @jax.jit
    def make():
        k = jax.random.split(_key(tokens * 19 + num_experts), 5)
        e4m3 = lambda key, shape: jax.random.uniform(key, shape, jnp.float32, 0.5, 2.0).astype(FP8)  # noqa: E731
        return (jax.random.normal(k[0], (tokens, d), jnp.bfloat16),
                jax.random.bits(k[1], (num_experts, 2, i, d // 2), jnp.uint8), e4m3(k[2], (num_experts, 2, i, d // 16)),
                jax.random.bits(k[3], (num_experts, d, i // 2), jnp.uint8), e4m3(k[4], (num_experts, d, i // 16)))

    def op(backend):
        def run(x, p1, s1, p2, s2):
            g = jnp.full((num_experts,), 1e-3, jnp.float32)
            q = dict(w_gate_up_packed=p1, w_gate_up_scale=s1, w_gate_up_gscale=g, w_down_packed=p2,
                     w_down_scale=s2, w_down_gscale=g)
            return experts.routed_experts_nvfp4(x, jnp.asarray(idx), jnp.asarray(weights), q, backend=backend)[0]
        return jax.jit(run)

    def tiled(**tiles):
        order = np.argsort(idx.reshape(-1), kind="stable")
        sizes = np.bincount(idx.reshape(-1), minlength=num_experts).astype(np.int32)

        def run(x, p1, s1, p2, s2):
            g = jnp.full((num_experts,), 1e-3, jnp.float32)
            return nvfp4_grouped_matmul(x[order // top_k], p1.reshape(num_experts, 2 * i, -1),
                                        s1.reshape(num_experts, 2 * i, -1), g, jnp.asarray(sizes), **tiles)
        return jax.jit(run)

    moved = touched * 3 * d * i * (0.5 + 1 / 16) + 2 * tokens * d * 2
    backends = {b: op(b) for b in OPS["expert_gemm"].backends if b in ("xla", "blocked", "pallas")}
    return Case("expert_gemm", label, make, backends, tiled, moved, 2 * 3 * tokens * top_k * d * i,
                kernel="expert_gemm_nvfp4")


def cases(rehearse: bool) -> list[Case]:
    """Every op's shapes, the most informative first (DeepSeek-V3's widths; tiny ones for the rehearsal)."""
    if rehearse:
        return [mla_case("b2 ctx64", 2, 4, 64, 64, 16, 16), expert_case("t2 E4", 2, 4, 2, 128, 128),
                projection_case("m4 128x128", 4, 128, 128), mla_case("b2 top32", 2, 4, 64, 64, 16, 16, topk=32),
                nvfp4_expert_case("t2 E4", 2, 4, 2, 128, 128),
                mla_case("b1 ctx32", 1, 4, 32, 64, 16, 16), expert_case("t4 E4", 4, 4, 2, 128, 128)]
    h, c, r, page = 128, 512, 64, 64  # one DP-attention rank holds all of MLA's heads
    return [
        mla_case("b64 ctx8192", 64, h, 8192, c, r, page), expert_case("t1 E256", 1, 256, 8, 7168, 2048),
        projection_case("o_proj m32", 32, 16384, 7168), mla_case("b64 top2048", 64, h, 8192, c, r, page, topk=2048),
        nvfp4_expert_case("t1 E256", 1, 256, 8, 7168, 2048),
        mla_case("b256 ctx2048", 256, h, 2048, c, r, page), mla_case("b1 ctx8192", 1, h, 8192, c, r, page),
        expert_case("t32 E256", 32, 256, 8, 7168, 2048), expert_case("t256 E256", 256, 256, 8, 7168, 2048),
        projection_case("gate_up m1", 1, 7168, 36864), projection_case("o_proj m256", 256, 16384, 7168),
        projection_case("gate_up m2048", 2048, 7168, 36864), nvfp4_expert_case("t64 E256", 64, 256, 8, 7168, 2048),
    ]


def tile_candidates(kernel: Kernel, previous: dict | None) -> list[dict]:
    """The kernel's default tiles, the last run's winner, then each parameter changed alone from the default."""
    out = [dict(kernel.defaults)]
    if previous and previous != kernel.defaults:
        out.append({**kernel.defaults, **previous})
    for name, values in kernel.choices.items():
        out += [{**kernel.defaults, name: v} for v in values]
    seen, unique = set(), []
    for tiles in out:
        key = tuple(sorted(tiles.items()))
        if key not in seen:
            seen.add(key)
            unique.append(tiles)
    return unique


def describe_tiles(tiles: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in tiles.items() if v is not None) or "defaults"


def measure(fn, args, iters: int, reference) -> dict:
    """Median microseconds of fn(*args), its largest difference from `reference` and its largest magnitude; an
    error as one line."""
    try:
        seconds, out = time_call(fn, args, iters)
    except Exception as e:  # one failing candidate (compile error, out of memory) must not end the sweep
        return dict(us=math.nan, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", diff=math.nan,
                    scale=math.nan, out=None)
    diff, scale = math.nan, float(jnp.max(jnp.abs(out.astype(jnp.float32))))
    if reference is not None and reference.shape == out.shape:
        diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
    return dict(us=seconds * 1e6, error=None, diff=diff, scale=scale, out=out)


def work(all_cases: list[Case], previous: dict[str, dict], max_tiles: int | None = None):
    """(case, [(kind, candidate, tiles)]) in the order the sweep runs them: every op's backends at its first
    shape, at its other shapes, then each kernel's tiles over its shapes (the first `max_tiles` candidates)."""
    platform = platform_of()
    firsts = {c.op: c for c in reversed(all_cases)}
    first_cases = [c for c in all_cases if firsts[c.op] is c]
    for case in first_cases + [c for c in all_cases if firsts[c.op] is not c]:
        backends = [b for b in case.backends if runs_here(b, platform)]
        if len(backends) > 1:
            yield case, [("backend", b, None) for b in backends]
    for case in all_cases:
        kernel = case.kernel or case.op
        if case.tiled is not None and runs_here("pallas", platform):
            tiles = tile_candidates(KERNELS[kernel], previous.get(kernel))[:max_tiles]
            yield case, [("tiles", describe_tiles(t), t) for t in tiles]


def sweep(all_cases: list[Case], until: float, iters: int, emit: Callable[[dict], None],
          previous: dict[str, dict] | None = None, max_tiles: int | None = None) -> None:
    """Time every candidate of `work(...)` beside its baseline (the op's xla backend; for tiles, the kernel's
    default tiles), until `until`; `emit` each result."""
    for case, candidates in work(all_cases, previous or {}, max_tiles):
        if time.time() >= until:
            emit(dict(event="deadline", op=case.op, case=case.label))
            return
        args = case.make()
        # the baseline: the op's xla backend for its backends, the kernel's default tiles for its tiles
        if candidates[0][0] == "backend":
            base = measure(case.backends["xla"], args, iters, None) if "xla" in case.backends else None
        else:
            base = measure(case.tiled(**candidates[0][2]), args, iters, None)
        for kind, name, tiles in candidates:
            if time.time() >= until:
                emit(dict(event="deadline", op=case.op, case=case.label))
                return
            if base is not None and (name == "xla" if kind == "backend" else tiles == candidates[0][2]):
                r = base
            else:
                fn = case.backends[name] if kind == "backend" else case.tiled(**tiles)
                r = measure(fn, args, iters, None if base is None else base["out"])
            row = dict(event="sweep", op=case.op, kernel=case.kernel or case.op, case=case.label, kind=kind,
                       candidate=name, tiles=tiles, us=r["us"], base_us=None if base is None else base["us"],
                       max_abs_diff=r["diff"], base_max_abs=None if base is None else base["scale"],
                       error=r["error"], bytes=case.bytes, flops=case.flops)
            emit(row)
            print(f"sweep: {case.op} {case.label} {kind} {name}: {r['us']:.1f} us"
                  + (f" (baseline {base['us']:.1f} us, max diff {r['diff']:.2e})" if base else "")
                  + (f" FAILED {r['error']}" if r["error"] else ""), flush=True)
        del args, base


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.gpu_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl", required=True, help="append one JSON line per timed candidate here")
    ap.add_argument("--until", type=float, required=True, help="start nothing after this time (epoch seconds)")
    ap.add_argument("--rehearse", action="store_true", help="the CPU rehearsal: tiny shapes, interpret mode")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per candidate (default 10; 2 rehearsing)")
    ap.add_argument("--previous", help="a gpu.json of an earlier run: its tile winners are tried early")
    ap.add_argument("--ops", help="only these ops, comma-separated (default: all of OPS with a choice)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = {}
    if args.previous:
        with open(args.previous) as f:
            previous = json.load(f).get("tile_winners", {})
    previous = {k: v["tiles"] for k, v in previous.items() if isinstance(v, dict) and "tiles" in v}
    chosen = cases(args.rehearse)
    if args.ops:
        wanted = set(args.ops.split(","))
        unknown = wanted - set(OPS)
        if unknown:
            raise SystemExit(f"--ops names {', '.join(sorted(unknown))}, which are not ops: choose from "
                             f"{', '.join(OPS)}")
        chosen = [c for c in chosen if c.op in wanted]

    def emit(row: dict) -> None:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")

    single = [op for op, spec in OPS.items() if len(spec.backends) == 1]
    emit(dict(event="single_backend", ops=single))
    sweep(chosen, args.until, args.iters or (2 if args.rehearse else 10), emit, previous,
          max_tiles=3 if args.rehearse else None)  # (a rehearsal: each kernel's defaults and two changes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
