"""`python -m jaxdp.bench.constrained`: the engine's host time per step with every row constrained by a grammar,
beside the same load unconstrained.

The device step is the stand-in of `python -m jaxdp.bench.engine --host-only` (`jaxdp.testing.HostOnlyRunner`:
it returns at once), so what is timed is the engine loop's own work per step: scheduling, the step's arrays,
and for constrained rows the [dp, B, ceil(V/32)] bitmask each matcher fills, the booking of each token to its
matcher, and the in-flight step booked before the next is planned (a constrained row's bitmask needs its last
token: the overlap is off while such requests run). The matcher is a stand-in too (it allows every token and
writes its bitmask row as a copy of a ready one), so the grammar backend's own fill and accept time, which
`python -m jaxdp.bench.grammar` measures, is not in these figures. Prints one line per run and writes JSON.

`--served`: the engine itself (the default model unless `--model-path` names another, its real steps and
tokenizer) under the grammar backend the server uses (`--grammar-backend`, llguidance by default), C requests at
once, the same prompts without and with one JSON schema (what `response_format: {"type": "json_schema"}` hands the
engine), in alternating rounds (the first pair warms up; the rest are reported): output tokens/s and the
constrained/unconstrained ratio, at equal output lengths (the schema's answers are longer than `--output-len`, and
unconstrained requests ignore EOS, so every request writes exactly `--output-len` tokens; checked), beside the
decode step's host and device time. Then the schema's compile time through the server's grammar service, uncached
(a new service: compile and one matcher) and cached (one more matcher), median of five.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import time

import numpy as np

from jaxdp.bench.cpu import thread_cpu_seconds
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.sched.request import GrammarSpec
from jaxdp.engine.step.controls import bitmask_words
from jaxdp.grammar import Grammars, vocabulary
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


# one JSON schema whose answers are long: at least 24 items of >= 17 characters, far past --output-len tokens
LONG_SCHEMA = {
    "type": "object", "required": ["title", "items"],
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "items": {"type": "array", "minItems": 24, "items": {
            "type": "object", "required": ["id", "tag"],
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                           "tag": {"type": "string", "maxLength": 8}}}}}}


def served_round(engine: Engine, prompts: list[list[int]], output_len: int, spec: GrammarSpec | None) -> dict:
    sp = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=spec is None, grammar=spec)
    engine.stats.records.clear()
    engine.flush_cache()
    cpu0, t0 = thread_cpu_seconds(os.getpid()), time.perf_counter()
    reqs = engine.generate(prompts, sp)
    wall, cpu1 = time.perf_counter() - t0, thread_cpu_seconds(os.getpid())
    lengths = sorted({len(r.output_ids) for r in reqs})
    if lengths != [output_len]:
        raise RuntimeError(f"unequal output lengths {lengths} (finish reasons "
                           f"{sorted({str(r.finish_reason) for r in reqs})}): the comparison needs {output_len} each")
    decode = [r for r in engine.stats.records if r.kind == "decode"]
    tokens = sum(len(r.output_ids) for r in reqs)
    return {"constrained": spec is not None, "concurrency": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "decode_steps": len(decode),
            "decode_host_ms": 1e3 * float(np.mean([r.host_s for r in decode])),
            "decode_step_ms": 1e3 * float(np.mean([r.step_s for r in decode])),
            # CPU per output token by kind of thread (main: the engine's loop, the host; other: XLA's, the steps):
            # what the load of other processes changes least
            "cpu_us_per_token": {k: 1e6 * (cpu1[k] - cpu0[k]) / tokens for k in cpu1}}


def compile_times(backend: str, vocab, spec: GrammarSpec, repeats: int = 5) -> dict:
    """The schema's start through the server's grammar service (`jaxdp.grammar.Grammars`), in ms: uncached (a new
    service: the compile and one matcher) and cached (one more matcher), median of `repeats`."""
    uncached, cached = [], []
    for _ in range(repeats):
        service = Grammars.create(backend, vocab)
        try:
            t0 = time.perf_counter()
            service.start(spec).result()
            t1 = time.perf_counter()
            service.start(spec).result()
            t2 = time.perf_counter()
        finally:
            service.close()
        uncached.append(t1 - t0)
        cached.append(t2 - t1)
    return {"uncached_ms": 1e3 * float(np.median(uncached)), "cached_ms": 1e3 * float(np.median(cached))}


def served(args: argparse.Namespace) -> int:
    lay = parse_mesh_spec(args.mesh)
    ensure_host_devices(lay.world)
    per_rank = max(1, -(-args.concurrency // lay.dp))
    ctx = args.input_len + args.output_len
    cfg = EngineConfig(page_size=args.page_size, num_pages=per_rank * -(-ctx // args.page_size) + 8,
                       max_running_requests=per_rank * lay.dp, chunked_prefill_size=max(256, args.input_len) * lay.dp,
                       decode_buckets=[per_rank], context_length=ctx + args.page_size)
    engine = Engine(args.model_path, args.mesh, cfg)
    vocab = vocabulary(engine.tokenizer, engine.runner.cfg.vocab_size)
    if vocab is None:
        raise SystemExit(f"error: {args.model_path} has no tokenizer with an end token; --served needs one (the "
                         "grammar backend reads it)")
    engine.grammars = Grammars.create(args.grammar_backend, vocab)
    engine.accepts_grammars = True
    spec = GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab.vocab_size, args.input_len).tolist() for _ in range(args.concurrency)]
    rounds = []
    try:
        for _ in range(1 + args.rounds):  # (the first pair warms up)
            for grammar in (None, spec):
                rounds.append(served_round(engine, prompts, args.output_len, grammar))
    finally:
        engine.shutdown()
    times = compile_times(args.grammar_backend, vocab, spec)
    report = rounds[2:]
    # each round's constrained tok/s over the unconstrained round just before it (the machine's load drifts)
    pairs = list(zip(report[::2], report[1::2], strict=True))
    ratios = [c["tokens_per_s"] / u["tokens_per_s"] for u, c in pairs]
    cpu_ratios = [sum(u["cpu_us_per_token"].values()) / sum(c["cpu_us_per_token"].values()) for u, c in pairs]
    host = {k: float(np.median([r["decode_host_ms"] for r in report if r["constrained"] == k])) for k in (False, True)}
    for r in report:
        print(f"{args.mesh} C={r['concurrency']} {'constrained  ' if r['constrained'] else 'unconstrained'} "
              f"{r['tokens_per_s']:8.1f} output tok/s  ({r['output_tokens']} tokens in {r['wall_s']:.2f} s; decode "
              f"step {r['decode_step_ms']:6.2f} ms, its host {r['decode_host_ms']:6.2f} ms, {r['decode_steps']} "
              f"steps; CPU us a token: loop {r['cpu_us_per_token']['main']:.0f}, XLA "
              f"{r['cpu_us_per_token']['other']:.0f})", flush=True)
    print(f"constrained / unconstrained output tok/s: median {np.median(ratios):.3f} of {len(ratios)} pairs of "
          f"rounds (min {min(ratios):.3f}, max {max(ratios):.3f}); {args.output_len} tokens a request; host time a "
          f"decode step (median): {host[False]:.2f} ms unconstrained, {host[True]:.2f} ms constrained")
    print(f"unconstrained / constrained CPU a token (the tok/s ratio a machine to ourselves would give, all CPU "
          f"bound): median {np.median(cpu_ratios):.3f} (min {min(cpu_ratios):.3f}, max {max(cpu_ratios):.3f})")
    print(f"the schema ({len(spec.text)} characters) through the {args.grammar_backend} grammar service: uncached "
          f"{times['uncached_ms']:.2f} ms, cached {times['cached_ms']:.3f} ms (median of 5)")
    with open(args.json, "w") as f:
        json.dump({"mesh": args.mesh, "model": args.model_path, "backend": args.grammar_backend,
                   "schema": LONG_SCHEMA, "rounds": report, "ratios": ratios,
                   "ratio_median": float(np.median(ratios)),
                   "cpu_ratios": cpu_ratios, "cpu_ratio_median": float(np.median(cpu_ratios)),
                   "decode_host_ms_median": host, "compile": times}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.constrained", description=__doc__.split("\n\n")[0])
    ap.add_argument("--served", action="store_true",
                    help="the engine with its model and the grammar backend (defaults: the default model, C=64, "
                         "2 rounds each): output tok/s constrained against unconstrained, and the schema's "
                         "compile time")
    ap.add_argument("--grammar-backend", default="llguidance", help="--served: the server's grammar backend")
    ap.add_argument("--rounds", type=int, default=2, help="--served: measured rounds of each (after a warm-up)")
    ap.add_argument("--model-path", help="a preset: its vocabulary sizes the bitmask (default deepseek-v3; --served: "
                    "the model served, default the embedded default model)")
    ap.add_argument("--mesh", default="dp=8")
    ap.add_argument("--concurrency", type=int, help="requests at once (default 256; --served: 64)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default="bench_constrained.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.model_path = args.model_path or ("default" if args.served else "deepseek-v3")
    args.concurrency = args.concurrency or (64 if args.served else 256)
    if args.served:
        return served(args)
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
