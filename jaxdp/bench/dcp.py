"""`python -m jaxdp.bench.dcp`: decode context parallelism (`--dcp-size`) against the unsplit pool, on this
machine's devices with the embedded default model.

For each of dcp=1 and dcp=N on the same mesh it reports the pool a rank gets at the serve path's default sizing
(`--mem-fraction-static`'s: the same memory per device), its tokens per attention group and its bytes per device,
then reads one prompt of `--context` tokens (in chunks) and a second sharing all but its last tokens (a prefix-cache
hit), greedily, and compares the answers: token ids equal, and the largest difference of their logprobs.

    python -m jaxdp.bench.dcp --mesh dp=2,tp=4 --dcp-size 4 --context 1024 --output dcp.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.serve_config import PoolSizing, pool_pages


def run(mesh: str, dcp: int, context: int, new_tokens: int, page_size: int) -> dict:
    pages = -(-(context + 2 * new_tokens) // page_size) + 2
    cfg = EngineConfig(page_size=page_size, num_pages=pages, context_length=pages * page_size,
                       max_running_requests=8, chunked_prefill_size=512, disable_cuda_graph=True)
    t0 = time.perf_counter()
    eng = Engine("default", mesh, cfg, warmup=False, dcp_size=dcp)
    runner = eng.runner
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(10, runner.cfg.vocab_size - 10, size=context)]
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, return_logprob=True)
    first = eng.generate([prompt], sp, ranks=[0])[0]
    hit = eng.generate([prompt[:-8] + prompt[-8:][::-1]], sp, ranks=[0])[0]
    sized = pool_pages(PoolSizing(), runner, 0)
    out = {"dcp": dcp, "sized_pages_per_rank": sized, "tokens_per_group": sized * runner.page_size,
           "pool_bytes_per_device": sized * runner.page_size * runner.pool_bytes_per_token,
           "tokens": [first.output_ids, hit.output_ids], "logprobs": [first.output_logprobs, hit.output_logprobs],
           "cached_tokens": hit.cached_tokens, "seconds": time.perf_counter() - t0}
    eng.shutdown()
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.dcp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="dp=2,tp=4")
    ap.add_argument("--dcp-size", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--output", default=None, help="write the results as JSON")
    a = ap.parse_args(argv)
    whole, split = (run(a.mesh, d, a.context, a.new_tokens, a.page_size) for d in (1, a.dcp_size))
    diff = max(abs(x - y) for lw, ls in zip(whole["logprobs"], split["logprobs"], strict=True)
               for x, y in zip(lw, ls, strict=False))
    result = {"mesh": a.mesh, "context": a.context, "whole": whole, "split": split,
              "tokens_equal": whole["tokens"] == split["tokens"], "max_logprob_diff": diff}
    print(f"| {a.mesh} | pages per rank | tokens per group | pool bytes per device | s |")
    print("|---|---:|---:|---:|---:|")
    for r in (whole, split):
        print(f"| dcp={r['dcp']} | {r['sized_pages_per_rank']:,} | {r['tokens_per_group']:,} | "
              f"{r['pool_bytes_per_device']:,} | {r['seconds']:.0f} |")
    print(f"context {a.context} + {a.new_tokens} new tokens, prefix-cache hit of {split['cached_tokens']} tokens: "
          f"tokens equal {result['tokens_equal']}, largest logprob difference {diff:.2e}")
    if a.output:
        with open(a.output, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
