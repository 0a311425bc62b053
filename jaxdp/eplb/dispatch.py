"""`python -m jaxdp.eplb.dispatch`: static against dynamic expert dispatch (`--ep-dispatch-algorithm`) on skewed
synthetic batches, computed by the step's own functions on the host's CPU, no model: how many (row, choice) pairs each
device's experts receive in one step, as balancedness (mean / max pairs a device; 1.0 is perfect).

Each case: W devices each with T rows of top-K choices drawn from a zipf-like expert load (1 / rank^1.2, a random
order), padding rows left out; the placement is the EPLB algorithm's for the expected load ("placed for the load") or
for another draw of the same family ("placed for another load": routing that drifted since the last rebalance).
Static: `jaxdp.model.moe.MoE.physical_choices` (replica (row + choice) mod count). Dynamic:
`jaxdp.model.moe.dynamic_slots` with every device's counts. Printed per case: the mean over the steps of each
dispatch's balancedness, and the worst step's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.eplb.placement import ExpertPlacement
from jaxdp.eplb.slots import map_arrays
from jaxdp.model.moe import dynamic_slots


@dataclasses.dataclass(frozen=True)
class DispatchCase:
    experts: int
    top_k: int
    devices: int
    redundant: int
    rows: int  # a device's rows in one step
    drifted: bool  # placed for another draw of the load


CASES = (
    DispatchCase(8, 2, 8, 8, 16, False),  # this machine's test model under dp=8,moe=ep
    DispatchCase(8, 2, 8, 8, 16, True),
    DispatchCase(256, 8, 8, 32, 16, False),  # DeepSeek-V3's experts: decode, 16 rows a device
    DispatchCase(256, 8, 8, 32, 256, False),  # a prompt step
    DispatchCase(256, 8, 8, 32, 16, True),
    DispatchCase(256, 8, 32, 32, 16, False),  # 32 devices
    DispatchCase(256, 8, 32, 32, 16, True),
)


def zipf_load(experts: int, rng) -> np.ndarray:
    return rng.permutation(1.0 / np.arange(1, experts + 1) ** 1.2)


def static_slots(idx_WTK: np.ndarray, slots_ES: np.ndarray, replicas_E: np.ndarray, num_physical: int) -> np.ndarray:
    """Static dispatch as the step does it: device w's row t, choice k of expert e to e's replica (w T + t + k) mod
    its count (the padding sentinel E to P)."""
    W, T, K = idx_WTK.shape
    E = slots_ES.shape[0]
    e = np.minimum(idx_WTK, E - 1)
    turn = np.arange(W)[:, None, None] * T + np.arange(T)[None, :, None] + np.arange(K)[None, None, :]
    slot = slots_ES[e, turn % replicas_E[e]]
    return np.where(idx_WTK < E, slot, num_physical)


def balancedness(slot_WTK: np.ndarray, num_physical: int, devices: int) -> float:
    live = slot_WTK < num_physical
    per_device = np.bincount(slot_WTK[live] // (num_physical // devices), minlength=devices)
    return float(per_device.mean() / per_device.max()) if per_device.max() else 1.0


def run_case(case: DispatchCase, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    E, K, W, P = case.experts, case.top_k, case.devices, case.experts + case.redundant
    load = zipf_load(E, rng)
    placed_for = zipf_load(E, rng) if case.drifted else load
    placement = ExpertPlacement.from_load(np.rint(placed_for * 1e6)[None].astype(np.int64), case.redundant, W)
    slots, replicas = (a[0] for a in map_arrays(placement))
    fn = jax.jit(jax.vmap(dynamic_slots, in_axes=(0, None, 0, None, None, None)), static_argnums=5)
    static, dynamic = [], []
    p = load / load.sum()
    for _ in range(steps):
        idx = np.stack([np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(case.rows)])
                        for _ in range(W)])
        counts = np.stack([np.bincount(i.reshape(-1), minlength=E) for i in idx])
        got = np.asarray(fn(jnp.asarray(idx), jnp.asarray(counts), jnp.arange(W), jnp.asarray(slots),
                            jnp.asarray(replicas), P))
        static.append(balancedness(static_slots(idx, slots, replicas, P), P, W))
        dynamic.append(balancedness(got, P, W))
    return {**dataclasses.asdict(case), "steps": steps, "static_mean": float(np.mean(static)),
            "static_worst": float(np.min(static)), "dynamic_mean": float(np.mean(dynamic)),
            "dynamic_worst": float(np.min(dynamic))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.eplb.dispatch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="steps (batches) per case")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    if args.steps < 1:
        print("error: --steps must be at least 1.", file=sys.stderr)
        return 2
    rows = [run_case(case, args.steps, args.seed) for case in CASES]
    print("balancedness = mean / max (row, choice) pairs a device receives in one step; mean over the steps (worst)")
    print("| E | top-k | devices | R | rows a device | placed for | static | dynamic |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['experts']} | {r['top_k']} | {r['devices']} | {r['redundant']} | {r['rows']} | "
              f"{'another load' if r['drifted'] else 'the load'} | {r['static_mean']:.3f} ({r['static_worst']:.3f}) | "
              f"{r['dynamic_mean']:.3f} ({r['dynamic_worst']:.3f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
