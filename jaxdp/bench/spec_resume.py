"""`python -m jaxdp.bench.spec_resume`: acceptance after speculation resumes (docs/speculative.md).

The default model offline (dp=1), N held-out long-skill problems at once, greedy: speculating all along, then
switched off above K requests held (`--speculative-disable-by-batch-size K`: a plain stretch while more are held,
verifies again as the batch shrinks). Prints each run's accept length and step kinds, whether the tokens are the
same, and the accept length of the requests that speculated again after the stretch against the same requests
speculating all along; writes JSON. Not in CI."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxdp.engine.loop import Engine
from jaxdp.engine.options import EngineConfig, SpeculativeConfig
from jaxdp.engine.sched.request import SamplingParams
from jaxdp.model.loader import default_model_path
from jaxdp.tokenizer import Tokenizer
from jaxdp.training.data import LONG, sample_problem


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.spec_resume", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="problems run at once (N)")
    ap.add_argument("--off-above", type=int, default=16, help="--speculative-disable-by-batch-size (K)")
    ap.add_argument("--json", default="benchmarks/results/spec_resume.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    n, k = args.requests, args.off_above
    tok = Tokenizer.from_dir(default_model_path())
    rng = np.random.default_rng(0)
    prompts = [tok.encode(sample_problem(rng, LONG[i % 2], held_out=True).prompt) for i in range(n)]
    params = SamplingParams(max_new_tokens=72, temperature=0.0)
    runs = {}
    for name, off in (("always", None), (f"off above {k}", k)):
        cfg = EngineConfig(max_running_requests=n, chunked_prefill_size=1024,
                           speculative=SpeculativeConfig(disable_by_batch_size=off))
        engine = Engine("default", "dp=1", cfg)
        t0 = time.perf_counter()
        reqs = engine.generate(prompts, params)
        kinds = [r.kind for r in engine.pipeline.stats.records]
        verifies, accepted = sum(r.spec_verify_ct for r in reqs), sum(r.spec_accepted for r in reqs)
        runs[name] = {"accept_length": 1 + accepted / verifies if verifies else 0.0, "verifies": verifies,
                      "steps": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
                      "seconds": time.perf_counter() - t0, "tokens": [r.output_ids for r in reqs],
                      "per_request": [(r.spec_verify_ct, r.spec_accepted) for r in reqs]}
        print(name, {key: v for key, v in runs[name].items() if key not in ("tokens", "per_request")}, flush=True)
        engine.shutdown()
    always, off = runs["always"], runs[f"off above {k}"]
    # the requests that verified after the stretch, against the same requests speculating all along
    resumed = [i for i, (v, _) in enumerate(off["per_request"]) if v > 0]

    def accept(run):
        v = sum(run["per_request"][i][0] for i in resumed)
        return 1 + sum(run["per_request"][i][1] for i in resumed) / v if v else 0.0

    summary = {"same_tokens": always["tokens"] == off["tokens"], "resumed_requests": len(resumed),
               "resumed_accept_always": accept(always), "resumed_accept_off_above": accept(off),
               "load_average": os.getloadavg()[0]}
    print(f"same tokens: {summary['same_tokens']}; {len(resumed)} requests speculated again: accept length "
          f"{summary['resumed_accept_off_above']:.3f} (speculating all along: {summary['resumed_accept_always']:.3f})")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"runs": runs, **summary, "requests": n, "off_above": k}, f)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
