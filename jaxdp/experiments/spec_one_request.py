"""`python -m jaxdp.experiments.spec_one_request`: the single-request point of `recipes` alone, side by side
(docs/speculative.md). For each mesh (tp=4, dp=4) a fresh plain server and a fresh speculating one (MTP, SGLang's
defaults), with recipes' own flags and load: 4 held-out long-skill problems one at a time after one warm-up request
(the recipes' point), then 16 more on the same server. Each row: output tok/s, mean TTFT and TPOT, the load
average before and after. A fresh server matters: the recipes' one-request point is the first load a server gets.
Not in CI: it times this machine."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from jaxdp.experiments.recipes import LAYOUTS, OUTPUT_LEN, prompts_file
from jaxdp.experiments.runner import Context, context_for
from jaxdp.model.loader import default_model_path

TOP = 256  # recipes' --max-running-requests (its full run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.experiments.spec_one_request",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="tp=4,dp=4", help=f"','-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--json", default="benchmarks/results/experiments/spec_one_request.json")
    args = ap.parse_args(argv)
    ctx = Context("spec_one_request", False, Path("experiments-out"))
    dataset, _ = prompts_file(ctx, 4 * TOP)
    rows = []
    for name in args.meshes.split(","):
        for mode in ("plain", "mtp"):
            flags = ["--model-path", str(default_model_path()), "--max-running-requests", str(TOP),
                     "--max-total-tokens", str(2 * TOP * 256), "--chunked-prefill-size", "1024",
                     "--context-length", str(context_for(192)),
                     *(["--speculative-algorithm", "EAGLE"] if mode == "mtp" else [])]
            with ctx.server(LAYOUTS[name], *flags, label=mode, tokenizer=True) as url:
                for n in (4, 16):
                    before = os.getloadavg()[0]
                    p = ctx.bench(url, num_prompts=n, input_len=16, output_len=OUTPUT_LEN, concurrency=1,
                                  dataset=dataset)
                    row = {"mesh": name, "mode": mode, "prompts": n, "tok_s": p["output_throughput"],
                           "ttft_ms": p["ttft_ms"]["mean"], "tpot_ms": p["tpot_ms"]["mean"],
                           "load_average": [before, os.getloadavg()[0]],
                           "utc": time.strftime("%H:%M:%S", time.gmtime())}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    tok = {(r["mesh"], r["mode"], r["prompts"]): r["tok_s"] for r in rows}
    for name in args.meshes.split(","):
        for n in (4, 16):
            print(f"{name}, {n} prompts: MTP x{tok[name, 'mtp', n] / tok[name, 'plain', n]:.2f} "
                  f"({tok[name, 'mtp', n]:.0f} / {tok[name, 'plain', n]:.0f} tok/s)")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
