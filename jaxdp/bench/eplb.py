"""`python -m jaxdp.bench.eplb`: online EPLB on a skewed load (issue 47's goal on a CPU): balancedness per MoE layer
before and after a rebalance, greedy tokens before, during and after it, and the pause a chunk's move adds.

The model is the tiny preset (random weights, seeded) with a **rigged router bias**: each MoE layer's
`router_bias_E` is set to `--bias-scale` times a descending ramp over a per-layer permutation of the experts, so
group-free top-k routing favours a few experts of each layer (the bias only picks experts; the weights of the
chosen ones are the sigmoid scores as in DeepSeek-V3). It is served under `--mesh dp=8,moe=ep` with
`--ep-num-redundant-experts 8` (16 slots, 2 a device) from SGLang's default placement (every expert once, the spare
slots to the lowest ids).

Three rounds of the same C requests (random prompts, greedy, fixed length), in one engine:

1. **before**: recorded (`jaxdp.eplb.recorder`); balancedness per layer of the recorded tokens under the held map;
2. **during**: the rebalancer (`jaxdp.eplb.online`) decides a placement every `--every` steps from the tokens of
   those steps and moves one layer a step (`--eplb-rebalance-layers-per-chunk 1`) while the requests run;
3. **after**: rebalancing off, recorded again; balancedness per layer under the new map.

Balancedness is mean / max tokens a device for each layer, each expert's recorded tokens split evenly over its
replicas (SGLang's metric; the step's static dispatch splits them by row and choice, close to even). The greedy tokens
of the three rounds are compared. The pause: each chunk's move timed from its dispatch to its end
(`Rebalancer.move_seconds`), beside the median step of the rounds. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import jax
import numpy as np

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.options import ModelOptions
from jaxdp.engine.setup import make_runner
from jaxdp.engine.step.step_stats import compiles_total
from jaxdp.eplb.distribution import EplbConfig
from jaxdp.eplb.recorder import record
from jaxdp.layout import ensure_host_devices


def rig_router_bias(runner, scale: float, seed: int) -> np.ndarray:
    """Set each MoE layer's router bias to scale x a descending ramp over a random order of its experts; returns the
    biases [L, E]."""
    moe = runner.state["moe_layers"]["ffn"]
    old = moe["router_bias_E"].get_value()
    L, E = old.shape
    rng = np.random.default_rng(seed)
    ramp = scale * np.linspace(1.0, 0.0, E) ** 2
    bias = np.stack([ramp[rng.permutation(E)] for _ in range(L)]).astype(np.float32)
    moe["router_bias_E"].set_value(jax.device_put(bias, old.sharding))
    return bias


def one_round(engine, prompts, params, recording: bool) -> tuple[list[list[int]], dict | None, list[float]]:
    """The prompts run to completion: their tokens, the recording's dump (tokens, balancedness) and the steps' times."""
    if recording:
        record(engine.runner, "start")
    engine.stats.records.clear()
    out = [r.output_ids for r in engine.generate(prompts, params)]
    step_s = [r.step_s for r in engine.stats.records]
    if not recording:
        return out, None, step_s
    record(engine.runner, "stop")
    dump = record(engine.runner, "dump").distribution
    return out, {"logical_count": dump.logical_count.tolist(), "balancedness": dump.balancedness.tolist()}, step_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.eplb", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--redundant", type=int, default=8, help="--ep-num-redundant-experts")
    ap.add_argument("--bias-scale", type=float, default=0.3, help="the rigged router bias's largest value")
    ap.add_argument("--every", type=int, default=8, help="steps between two rebalances in the middle round")
    ap.add_argument("--seed", type=int, default=1, help="the weights, the bias order and the prompts")
    ap.add_argument("--json", default="bench_eplb.json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    spec = "dp=8,moe=ep"
    ensure_host_devices(8)
    per_rank = max(1, args.requests // 8)
    ctx = args.input_len + args.output_len
    cfg = EngineConfig(page_size=8, num_pages=per_rank * -(-ctx // 8) + 8, max_running_requests=per_rank * 8,
                       chunked_prefill_size=per_rank * args.input_len * 8, enable_prefix_cache=False,
                       context_length=ctx + 8, seed=args.seed,
                       eplb=EplbConfig(num_iterations=1 << 30, layers_per_chunk=1))
    t0 = time.perf_counter()
    runner = make_runner(ModelOptions("tiny", seed=args.seed, ep_num_redundant_experts=args.redundant), spec,
                         cfg.pool_pages, cfg.pool_page_size)
    bias = rig_router_bias(runner, args.bias_scale, args.seed)
    engine = Engine(runner, spec, cfg)
    warm = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    V = engine.model_cfg.vocab_size
    prompts = [rng.integers(1, V, args.input_len).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)
    compiles = compiles_total()
    before_tokens, before, before_steps = one_round(engine, prompts, params, recording=True)
    reb = engine.rebalancer
    reb.reset()
    reb.config = EplbConfig(num_iterations=args.every, layers_per_chunk=1)
    during_tokens, _, during_steps = one_round(engine, prompts, params, recording=False)
    while reb.pending is not None:  # (a rebalance decided at the round's last step: finish its chunks)
        reb.move_next_chunk()
    reb.config = EplbConfig(num_iterations=1 << 30, layers_per_chunk=1)
    after_tokens, after, after_steps = one_round(engine, prompts, params, recording=True)
    moves = [1e3 * s for s in reb.move_seconds]
    steps_ms = [1e3 * s for s in before_steps + after_steps]
    result = {
        "mesh": spec, "model": f"tiny (seed {args.seed}), rigged router bias", "router_bias": bias.tolist(),
        "redundant_experts": args.redundant, "requests": args.requests, "input_len": args.input_len,
        "output_len": args.output_len, "rebalance_every_steps": args.every, "warmup_s": warm,
        "before": before, "after": after,
        "rebalances_during": len(reb.move_seconds) // max(1, engine.model_cfg.num_moe_layers),
        "tokens_equal_during": during_tokens == before_tokens, "tokens_equal_after": after_tokens == before_tokens,
        "compiles_while_serving": compiles_total() - compiles,
        "move_ms": moves, "move_ms_median": float(np.median(moves)) if moves else None,
        "step_ms_median": float(np.median(steps_ms)), "steps_during": len(during_steps),
        "placement_after": reb.held_placement().physical_to_logical.tolist(),
    }
    engine.shutdown()
    print(f"{'layer':>5} {'before':>8} {'after':>8}")
    for layer, (b, a) in enumerate(zip(before["balancedness"], after["balancedness"], strict=True)):
        print(f"{layer:>5} {b:8.3f} {a:8.3f}")
    print(f"rebalances during the middle round: {result['rebalances_during']}; greedy tokens equal during: "
          f"{result['tokens_equal_during']}, after: {result['tokens_equal_after']}; compiles while serving: "
          f"{result['compiles_while_serving']}")
    print(f"a chunk's move (one layer): median {result['move_ms_median']:.2f} ms over {len(moves)} moves; "
          f"median step {result['step_ms_median']:.2f} ms")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
