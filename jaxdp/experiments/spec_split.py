"""`python -m jaxdp.experiments.spec_split`: where a speculative iteration's wall time goes (docs/speculative.md).

The default model offline, greedy long-skill problems, one engine per case: the plain engine (the overlap on) and
the speculating one (MTP, SGLang's defaults), and with --speculative-disable-by-batch-size 1 (plain stretches
while more than one request is held). Each decode iteration of the pipeline is split into: plan (the ranks'
schedulers), agree, arrays (the step's host arrays), dispatch (queueing the step and its sampling), wait (reading
a step's tokens back: the device's time the host did not hide), book (tokens to requests); ms per iteration and
per token. Prompt iterations are left out. Not in CI: it times this machine."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxdp.engine.loop import Engine
from jaxdp.engine.options import EngineConfig, SpeculativeConfig
from jaxdp.engine.sched.request import SamplingParams
from jaxdp.experiments.runner import write_rows
from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import LONG, sample_problem

PARTS = ("plan", "agree", "arrays", "dispatch", "wait", "book", "other")


def instrument(engine) -> list[dict]:
    """Time the pipeline's parts per iteration (wrapping the instance's methods); returns the list it fills."""
    pipe, iters = engine.pipeline, []
    cur: dict = {}

    def timed(obj, name, part):
        inner = getattr(obj, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                cur[part] = cur.get(part, 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapper)

    for s in pipe.schedulers:
        timed(s, "schedule", "plan")
        for name in ("book", "book_spec"):  # (a speculating engine books its plain stretches' steps by `book`)
            if hasattr(s, name):
                timed(s, name, "book")
    queue, book, step = pipe._queue, pipe._book, pipe.step

    def queue_w(plans, shape, rows, agreement, t0, agree_s):
        cur["kinds"] = {p.kind for p in plans if p is not None}
        cur["plain"] = not getattr(shape, "draft_tokens", 0)
        f = queue(plans, shape, rows, agreement, t0, agree_s)
        cur["agree"] = agree_s
        cur["arrays"] = f.host_s - cur.get("plan", 0.0) - agree_s
        cur["dispatch"] = f.dispatch_s
        return f

    def book_w(f, t_start):
        t = time.perf_counter()
        book(f, t_start)
        cur["book_total"] = cur.get("book_total", 0.0) + time.perf_counter() - t
        cur["tokens"] = cur.get("tokens", 0) + pipe.stats.records[-1].new_tokens
        cur["wait"] = cur.get("wait", 0.0) + pipe.stats.records[-1].wait_s

    def step_w():
        cur.clear()
        t = time.perf_counter()
        out = step()
        cur["wall"] = time.perf_counter() - t
        iters.append(dict(cur))
        return out

    pipe._queue, pipe._book, pipe.step = queue_w, book_w, step_w
    return iters


def summarize(iters: list[dict], prompt: bool = False) -> dict:
    """ms per decode iteration (prompt: per iteration that reads a prompt) of each part, tokens per iteration, ms
    per token."""
    dec = [i for i in iters if i.get("kinds") and (i["kinds"] <= {"decode", "verify"}) != prompt]
    if not dec:
        return {}
    out = {"iterations": len(dec), "plain_steps": sum(i["plain"] for i in dec),
           "seconds": float(sum(i["wall"] for i in dec))}
    for p in PARTS[:-1]:
        out[p] = 1e3 * float(np.mean([i.get(p, 0.0) for i in dec]))
    out["wall"] = 1e3 * float(np.mean([i["wall"] for i in dec]))
    out["other"] = out["wall"] - sum(out[p] for p in PARTS[:-1])
    out["tokens"] = float(np.mean([i.get("tokens", 0) for i in dec]))
    out["ms_per_token"] = out["wall"] / out["tokens"] if out["tokens"] else 0.0
    return out


def rounded(v):
    if isinstance(v, dict):
        return {k: rounded(x) for k, x in v.items()}
    return round(v, 2) if isinstance(v, float) else v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.experiments.spec_split", description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="dp=1,tp=4;dp=4", help="';'-separated --mesh specs")
    ap.add_argument("--requests", default="1,256", help="','-separated request counts")
    ap.add_argument("--cases", default="plain,mtp,mtp-off", help="plain, mtp, mtp-off (off above 1), plain-sync")
    ap.add_argument("--waves", type=int, default=1, help="problems per request slot: N x waves problems, N at once "
                    "(more than 1: new prompts join as answers end, as under a load of N concurrent requests)")
    ap.add_argument("--json", default="benchmarks/results/experiments/spec_split.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    tok = Tokenizer.from_dir(default_model_path())
    params = SamplingParams(max_new_tokens=72, temperature=0.0)
    results = []
    for mesh in args.meshes.split(";"):
        dp = int(mesh.split("dp=")[1].split(",")[0]) if "dp=" in mesh else 1
        for n in (int(x) for x in args.requests.split(",")):
            rng = np.random.default_rng(0)
            prompts = [tok.encode(sample_problem(rng, LONG[i % 2], held_out=True).prompt)
                       for i in range(n * args.waves)]
            tokens = {}
            for case in args.cases.split(","):
                if case == "mtp-off" and n == 1:
                    continue  # (one request: every step verifies)
                spec = {"plain": None, "plain-sync": None, "mtp": SpeculativeConfig(),
                        "mtp-off": SpeculativeConfig(disable_by_batch_size=1)}[case]
                per_rank = -(-n // dp)
                cfg = EngineConfig(max_running_requests=n, chunked_prefill_size=1024, speculative=spec,
                                   decode_buckets=sorted({1, per_rank}), overlap=case != "plain-sync")
                engine = Engine("default", mesh, cfg)
                overlap = engine.pipeline.cfg.overlap
                iters = instrument(engine)
                t0 = time.perf_counter()
                if n == 1:  # one request at a time (under dp=4 too: not one a rank)
                    reqs = [r for p in prompts for r in engine.generate([p], params)]
                else:
                    reqs = engine.generate(prompts, params)
                seconds = time.perf_counter() - t0
                tokens[case] = [r.output_ids for r in reqs]
                row = {"mesh": mesh, "requests": n, "case": case, "overlap": overlap, "seconds": seconds,
                       "tok_s": sum(len(r.output_ids) for r in reqs) / seconds,
                       "load_average": os.getloadavg()[0], "decode": summarize(iters),
                       "prompt": summarize(iters, prompt=True)}
                results.append(row)
                print(json.dumps(rounded(row)), flush=True)
                engine.shutdown()
            same = all(t == tokens[next(iter(tokens))] for t in tokens.values())
            print(f"{mesh} x{n}: the same greedy tokens in every case: {same}", flush=True)
    write_rows(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
