"""`python -m jaxdp.bench.roofline [--refresh]`: this machine's read bandwidth and dot throughput, as the
benchmarks' and `python -m jaxdp.one_batch`'s floors price a step (`jaxdp.planner.measured`): measured (a few
seconds) and cached, or shown from the cache.

A benchmark reports a step as "N x the floor": its time over `jaxdp.planner.measured.step_floor(...)`.
"""

from __future__ import annotations

import argparse

from jaxdp.cache import cache_dir
from jaxdp.planner.measured import machine


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--refresh", action="store_true", help="measure again (else the cached figures)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    m = machine(args.refresh)
    print(f"{m.key}: read {m.read_bytes_per_s / 1e9:.1f} GB/s, dot {m.f32_flops_per_s / 1e9:.0f} GFLOP/s float32, "
          f"{m.bf16_flops_per_s / 1e9:.0f} GFLOP/s bf16 (measured at load average {m.load_average:.2f}; "
          f"{cache_dir() / 'machine.json'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
