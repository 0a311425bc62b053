"""`python -m jaxdp.experiments.spec_one_request`: the single-request point of `recipes` alone, side by side
(docs/speculative.md). For each mesh (tp=4, dp=4) a fresh plain server and a fresh speculating one (MTP, SGLang's
defaults), with recipes' own flags and load: 4 held-out long-skill problems one at a time after one warm-up request
(the recipes' point), then 16 more on the same server. Each row: output tok/s, mean TTFT and TPOT, the load
average before and after. A fresh server matters: the recipes' one-request point is the first load a server gets.
With --rounds N the servers of a mesh are up at once and warm, and take N rounds of the 4 problems in turn (the
order reversed every other round): one server's speed moves up to 1.7x from start to start on this machine, so
the ratio of two servers measured one after the other says little; the rounds' median ratio says more. With
--concurrency C as well, each round is 4 x C problems, C at once (the recipes' other points; `mtp-off` is MTP
switched off above --off-above running requests, the recipes' third server).
Not in CI: it times this machine."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

from jaxdp.experiments.recipes import LAYOUTS, OUTPUT_LEN, prompts_file
from jaxdp.experiments.runner import Context, context_for, write_rows
from jaxdp.model.loader import default_model_path

TOP = 256  # recipes' --max-running-requests (its full run)
MODES = {"plain": [], "plain-sync": ["--disable-overlap-schedule"], "mtp": ["--speculative-algorithm", "EAGLE"],
         "mtp-off": ["--speculative-algorithm", "EAGLE", "--speculative-disable-by-batch-size"]}  # + --off-above


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.experiments.spec_one_request",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="tp=4,dp=4", help=f"','-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--modes", default="plain,mtp",
                    help="','-separated, of plain, plain-sync (--disable-overlap-schedule), mtp, mtp-off (MTP "
                         "switched off above --off-above running requests)")
    ap.add_argument("--off-above", type=int, default=64, metavar="N", help="mtp-off's threshold (default 64)")
    ap.add_argument("--concurrency", type=int, default=1, metavar="C",
                    help=f"with --rounds: requests at once (at most {TOP}), 4 x C problems a round (default 1: the "
                         "recipes' point)")
    ap.add_argument("--rounds", type=int, default=0, metavar="N",
                    help="the modes' servers up at once, N rounds of 4 problems on each in turn (default: fresh "
                         "servers one after another, 4 problems then 16)")
    ap.add_argument("--json", default="benchmarks/results/experiments/spec_one_request.json")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if "plain" not in modes or any(m not in MODES for m in modes) or args.rounds < 0 or not 0 < args.concurrency <= TOP:
        ap.error(f"--modes takes plain and any of {', '.join(MODES)}; --rounds a count >= 0, --concurrency 1 to {TOP}")
    if args.concurrency > 1 and not args.rounds:
        ap.error("--concurrency takes --rounds (the fresh-server run is the recipes' one-request point)")
    ctx = Context("spec_one_request", False, Path("experiments-out"))
    dataset, _ = prompts_file(ctx, 4 * TOP)

    def server(name: str, mode: str):
        flags = ["--model-path", str(default_model_path()), "--max-running-requests", str(TOP),
                 "--max-total-tokens", str(2 * TOP * 256), "--chunked-prefill-size", "1024",
                 "--context-length", str(context_for(192)), *MODES[mode],
                 *([str(args.off_above)] if mode == "mtp-off" else [])]
        return ctx.server(LAYOUTS[name], *flags, label=mode, tokenizer=True)

    def point(url: str, name: str, mode: str, n: int, **extra) -> dict:
        before = os.getloadavg()[0]
        p = ctx.bench(url, num_prompts=n, input_len=16, output_len=OUTPUT_LEN, concurrency=args.concurrency,
                      dataset=dataset)
        row = {"mesh": name, "mode": mode, "prompts": n, "concurrency": args.concurrency, **extra,
               "tok_s": p["output_throughput"], "ttft_ms": p["ttft_ms"]["mean"], "tpot_ms": p["tpot_ms"]["mean"],
               "load_average": [before, os.getloadavg()[0]], "utc": time.strftime("%H:%M:%S", time.gmtime())}
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    rows: list[dict] = []
    for name in args.meshes.split(","):
        if args.rounds:
            with ExitStack() as stack:
                urls = {mode: stack.enter_context(server(name, mode)) for mode in modes}
                for r in range(args.rounds):
                    for mode in modes if r % 2 == 0 else modes[::-1]:
                        point(urls[mode], name, mode, 4 * args.concurrency, round=r)
            continue
        for mode in modes:
            with server(name, mode) as url:
                for n in (4, 16):
                    point(url, name, mode, n)
    for name in args.meshes.split(","):
        mine = [r for r in rows if r["mesh"] == name]
        for mode in (m for m in modes if m != "plain"):
            if args.rounds:
                ratios = [a["tok_s"] / b["tok_s"] for a in mine for b in mine
                          if a["mode"] == mode and b["mode"] == "plain" and a["round"] == b["round"]]
                print(f"{name}, {args.rounds} rounds of {4 * args.concurrency} prompts, {args.concurrency} at once: "
                      f"{mode} / plain median "
                      f"x{statistics.median(ratios):.2f} (x{min(ratios):.2f}-{max(ratios):.2f})")
                continue
            tok = {(r["mode"], r["prompts"]): r["tok_s"] for r in mine}
            for n in (4, 16):
                print(f"{name}, {n} prompts: {mode} x{tok[mode, n] / tok['plain', n]:.2f} "
                      f"({tok[mode, n]:.0f} / {tok['plain', n]:.0f} tok/s)")
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
