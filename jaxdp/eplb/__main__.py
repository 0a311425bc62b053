"""`python -m jaxdp.eplb`: expert placements on the command line.

`--demo` prints balancedness (mean / max tokens per GPU under static dispatch) before (today's EP layout: device d
holds experts d * E/GPUs .., no redundant experts) and after (the EPLB algorithm with R redundant experts) on skewed
synthetic loads, at the sizes of this machine's test model and of DeepSeek-V3 (the table of docs/eplb.md).
`--location FILE` does the same for a recorded distribution (JSON or .npz with `logical_count` [L, E]) and, with
`--out`, writes the placement as `--init-expert-location` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from jaxdp.eplb.algorithm import POLICIES, PlacementError, choose_policy
from jaxdp.eplb.placement import LOAD_KEY, ExpertPlacement, read_location_file


@dataclasses.dataclass(frozen=True)
class DemoCase:
    """One row of the demo table: a synthetic load family at one size."""

    load: str  # "zipf" | "mild zipf" | "hot device" | "one hot"
    experts: int
    groups: int
    gpus: int
    nodes: int
    redundant: int
    layers: int = 4
    policy: str = "auto"


DEMO_CASES = (
    DemoCase("hot device", 8, 1, 8, 1, 8, layers=2),  # this machine's test model under dp=8,moe=ep
    DemoCase("zipf", 8, 1, 8, 1, 8, layers=2),
    DemoCase("zipf", 256, 8, 8, 1, 0),
    DemoCase("zipf", 256, 8, 8, 1, 8),
    DemoCase("zipf", 256, 8, 8, 1, 32),
    DemoCase("hot device", 256, 8, 8, 1, 32),
    DemoCase("one hot", 256, 8, 8, 1, 32),
    DemoCase("mild zipf", 256, 8, 8, 1, 32),
    DemoCase("zipf", 256, 8, 32, 4, 32),  # a hot group's node holds more than its share whatever the GPUs do
    DemoCase("zipf", 256, 8, 32, 4, 32, policy="global"),
    DemoCase("hot device", 256, 8, 32, 4, 32),
    DemoCase("hot device", 256, 8, 32, 4, 32, policy="global"),
    DemoCase("zipf", 256, 8, 64, 16, 64),  # 8 groups do not split over 16 nodes: the global policy
)


def skewed_load(kind: str, layers: int, experts: int, gpus: int, seed: int = 0,
                tokens_per_layer: float = 1e6) -> np.ndarray:
    """A synthetic skewed load [layers, experts] (tokens routed per expert):
    - "zipf": expert loads proportional to 1 / rank^1.2, experts in a random order per layer ("mild zipf": ^0.8);
    - "hot device": the experts of device 0 in today's layout carry half of all tokens, the rest spread evenly;
    - "one hot": one expert (random per layer) carries 20% of the tokens, the rest zipf-like."""
    rng = np.random.default_rng(seed)
    load = np.empty((layers, experts))
    for layer in range(layers):
        zipf = 1.0 / np.arange(1, experts + 1) ** (0.8 if kind == "mild zipf" else 1.2)
        if kind in ("zipf", "mild zipf"):
            row = rng.permutation(zipf)
        elif kind == "hot device":
            local = experts // gpus
            row = np.full(experts, 0.5 / (experts - local))
            row[:local] = 0.5 / local
        elif kind == "one hot":
            row = rng.permutation(zipf)
            row = 0.8 * row / row.sum()
            row[rng.integers(experts)] += 0.2
        else:
            raise PlacementError(f"unknown synthetic load {kind!r}; use zipf, mild zipf, hot device or one hot.")
        load[layer] = row / row.sum() * tokens_per_layer
    return load


def demo_rows(seed: int = 0) -> list[dict]:
    """Each demo case's balancedness before and after (mean over its layers, and the worst layer after)."""
    rows = []
    for case in DEMO_CASES:
        load = skewed_load(case.load, case.layers, case.experts, case.gpus, seed)
        before = ExpertPlacement.identity(case.layers, case.experts, case.gpus).balancedness(load)
        placed = ExpertPlacement.from_load(load, case.redundant, case.gpus, case.groups, case.nodes, case.policy)
        after = placed.balancedness(load)
        rows.append({**dataclasses.asdict(case), "policy": choose_policy(case.groups, case.nodes, case.policy),
                     "before": float(before.mean()), "after": float(after.mean()),
                     "after_worst_layer": float(after.min()),
                     "max_replicas": int(placed.replica_counts.max())})
    return rows


def print_demo(seed: int) -> None:
    print("balancedness = mean / max tokens per GPU (static dispatch); before: device d holds experts d*E/GPUs.., "
          "no redundant experts; after: EPLB with R redundant experts (mean over layers; worst layer)")
    print("| load | E | groups | GPUs | nodes | R | policy | before | after | after, worst layer | most replicas |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in demo_rows(seed):
        print(f"| {r['load']} | {r['experts']} | {r['groups']} | {r['gpus']} | {r['nodes']} | {r['redundant']} | "
              f"{r['policy']} | {r['before']:.3f} | {r['after']:.3f} | {r['after_worst_layer']:.3f} | "
              f"{r['max_replicas']} |")


def place_recorded(args: argparse.Namespace) -> None:
    """Balancedness per layer of a recorded distribution before and after; the placement written to --out."""
    data = read_location_file(args.location)
    if LOAD_KEY not in data:
        raise PlacementError(f"{args.location} holds a placement, not a recorded distribution; give a file with "
                             f"{LOAD_KEY}.")
    load = data[LOAD_KEY]
    layers, experts = np.shape(load) if np.ndim(load) == 2 else (0, 0)
    placed = ExpertPlacement.from_load(load, args.num_redundant, args.gpus, args.groups, args.nodes, args.policy)
    before = ExpertPlacement.identity(layers, experts, args.gpus).balancedness(load)
    after = placed.balancedness(load)
    print("layer  before  after")
    for layer in range(layers):
        print(f"{layer:5d}  {before[layer]:.3f}  {after[layer]:.3f}")
    if args.out:
        placed.save(args.out)
        print(f"placement written to {args.out}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxdp.eplb", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--demo", action="store_true", help="the balancedness table on skewed synthetic loads")
    what.add_argument("--location", help="a recorded distribution (JSON or .npz with logical_count [L, E])")
    p.add_argument("--seed", type=int, default=0, help="the synthetic loads' seed (--demo)")
    p.add_argument("--num-redundant", type=int, default=0, help="redundant experts R (E + R slots)")
    p.add_argument("--gpus", type=int, default=8, help="devices the experts are spread over")
    p.add_argument("--groups", type=int, default=1, help="expert groups (the model's n_group)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the devices are in")
    p.add_argument("--policy", choices=POLICIES, default="auto")
    p.add_argument("--out", help="write the placement here (.json or .npz), as --init-expert-location reads it")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.demo:
            print_demo(args.seed)
        else:
            place_recorded(args)
    except PlacementError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
