"""`python -m jaxdp.experiments NAME [--quick] [--output-dir D] [--json-dir J] [server flags such as --model-path]`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from jaxdp.experiments import crossover, ep, prompt_in_the_way, recipes, single_request, skew
from jaxdp.experiments.runner import Context, ExperimentError, check_server_flags

EXPERIMENTS = {"skew": skew, "single-request": single_request, "prompt-in-the-way": prompt_in_the_way, "ep": ep,
               "crossover": crossover, "recipes": recipes}


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ExperimentError(message)


def build_parser() -> argparse.ArgumentParser:
    """NAME and the experiments' own flags; any other flag goes to the servers (`main` checks those)."""
    p = Parser(prog="python -m jaxdp.experiments", description=__doc__,
               epilog="Any other flag goes to every server the experiment starts (python -m jaxdp.serve --help).")
    p.add_argument("name", choices=[*EXPERIMENTS, "all"], help="the experiment (all: one after another)")
    p.add_argument("--quick", action="store_true", help="small loads: 2 to 6 minutes each on 2 shared CPU cores")
    p.add_argument("--output-dir", default="experiments-out", help="where NAME.png and NAME.md go (and NAME.json "
                   "unless --json-dir)")
    p.add_argument("--json-dir", default=None, help="where the raw NAME.json goes (default: --output-dir)")
    p.add_argument("--disaggregated", action="store_true", help="prompt-in-the-way: the unpinned load colocated, "
                   "with the prefill delayer, and with prefill and decode on separate servers behind SGLang's "
                   "router (NAME: prompt-in-the-way-disaggregated)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args, server_flags = build_parser().parse_known_args(argv)
        check_server_flags(server_flags)
        if args.disaggregated and args.name != "prompt-in-the-way":
            raise ExperimentError("--disaggregated is an option of prompt-in-the-way only")
        for name in EXPERIMENTS if args.name == "all" else [args.name]:
            t0 = time.time()
            if args.disaggregated:  # (its own outputs: prompt-in-the-way's stay as they are)
                name = "prompt-in-the-way-disaggregated"
            ctx = Context(name, args.quick, Path(args.output_dir), server_flags,
                          json_dir=Path(args.json_dir) if args.json_dir else None)
            if args.disaggregated:
                prompt_in_the_way.run_disaggregated(ctx)
            else:
                EXPERIMENTS[name].run(ctx)
            print(f"[{name}] done in {time.time() - t0:.0f} s: {Path(args.output_dir) / name}.{{png,md}}, "
                  f"{ctx.json_path}")
            print(Path(f"{Path(args.output_dir) / name}.md").read_text())
    except ExperimentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
