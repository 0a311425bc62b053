"""`python -m jaxdp.bench.constrained`: the engine's host time per step with every row constrained by a grammar,
beside the same load unconstrained.

The device step is the stand-in of `python -m jaxdp.bench.engine --host-only` (`jaxdp.testing.HostOnlyRunner`:
it returns at once), so what is timed is the engine loop's own work per step: scheduling, the step's arrays,
and for constrained rows the [dp, B, ceil(V/32)] bitmask each matcher fills, the booking of each token to its
matcher, and the in-flight step booked before the next is planned (a constrained row's bitmask needs its last
token: the overlap is off while such requests run). The matcher is a stand-in too (it allows every token and
writes its bitmask row as a copy of a ready one), so the grammar backend's own fill and accept time, which
`python -m jaxdp.bench.grammar` measures, is not in these figures. Prints one line per run and writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import time

import numpy as np

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.sched.request import GrammarSpec
from jaxdp.engine.step.controls import bitmask_words
from jaxdp.layout import ensure_host_devices, parse_mesh_spec
from jaxdp.testing import HostOnlyRunner


class AllowAll:
    """A stand-in matcher: every token allowed, no end (its row written as a copy, as a real backend's is)."""

    def __init__(self, words: int):
        self.row = np.full(words, -1, np.int32)

    def fill(self, bitmask_W: np.ndarray) -> None:
        bitmask_W[:] = self.row

    def accept(self, token: int) -> bool:
        return True

    def terminated(self) -> bool:
        return False

    def reset(self) -> None:
        pass


class AllowAllGrammars:
    def __init__(self, vocab_size: int):
        self.words = bitmask_words(vocab_size)

    def start(self, spec: GrammarSpec) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(AllowAll(self.words))
        return fut


def run_one(engine: Engine, concurrency: int, input_len: int, output_len: int, grammar: bool) -> dict:
    rng = np.random.default_rng(0)
    V = engine.model_cfg.vocab_size
    prompts = [rng.integers(0, V, input_len).tolist() for _ in range(concurrency)]
    sp = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True,
                        grammar=GrammarSpec("json_object") if grammar else None)
    engine.stats.records.clear()
    engine.flush_cache()
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, sp)
    wall = time.perf_counter() - t0
    decode = [r for r in engine.stats.records if r.kind == "decode"]
    return {"constrained": grammar, "concurrency": concurrency, "decode_steps": len(decode),
            "decode_host_ms": 1e3 * float(np.mean([r.host_s for r in decode])),
            "decode_step_ms": 1e3 * float(np.mean([r.step_s for r in decode])),
            "tokens_per_s": sum(len(r.output_ids) for r in reqs) / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.constrained", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="deepseek-v3", help="a preset: its vocabulary sizes the bitmask")
    ap.add_argument("--mesh", default="dp=8")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default="bench_constrained.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    lay = parse_mesh_spec(args.mesh)
    ensure_host_devices(lay.world)
    per_rank = max(1, args.concurrency // lay.dp)
    ctx = args.input_len + args.output_len
    pages = per_rank * -(-ctx // args.page_size) + 8
    buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= per_rank} | {per_rank})
    cfg = EngineConfig(page_size=args.page_size, num_pages=pages, max_running_requests=per_rank * lay.dp,
                       chunked_prefill_size=64 * lay.dp, decode_buckets=buckets, context_length=ctx + args.page_size,
                       max_len_extend_rows=1 << 30)
    runner = HostOnlyRunner(args.model_path, args.mesh, pages, args.page_size)
    engine = Engine(runner, args.mesh, cfg, grammars=AllowAllGrammars(runner.cfg.vocab_size))
    results = []
    try:
        for grammar in (False, True, False, True):  # (twice each, alternating: the second pair is reported)
            results.append(run_one(engine, args.concurrency, args.input_len, args.output_len, grammar))
    finally:
        engine.shutdown()
    for r in results[2:]:
        print(f"{args.mesh} C={r['concurrency']} {'constrained  ' if r['constrained'] else 'unconstrained'} "
              f"decode host {r['decode_host_ms']:6.2f} ms/step  step {r['decode_step_ms']:6.2f} ms  "
              f"({r['decode_steps']} decode steps; vocabulary {runner.cfg.vocab_size}, "
              f"bitmask {bitmask_words(runner.cfg.vocab_size)} words a row)", flush=True)
    with open(args.json, "w") as f:
        json.dump(results[2:], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
