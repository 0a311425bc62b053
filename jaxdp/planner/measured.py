"""This machine as a device the planner's roofline prices: its read bandwidth and dot throughput, measured once
and cached, and the floor of a one-device step on it (`step_floor`: `jaxdp.planner.roofline.decode_roofline`, the
one model of what a step must read and compute). `python -m jaxdp.one_batch` and the benchmarks report a step as
"N x the floor": its time over `step_floor(...)`; `python -m jaxdp.bench.roofline [--refresh]` shows or measures
the figures.

The read bandwidth is a reduction over a 256 MiB float32 array (4 GiB on a GPU); the dot throughput a
[256, 2048] x [2048, 4096] product (8192 cubed on a GPU), in float32 and in bf16 with float32 accumulation (the
dot the model runs on bf16 weights). Both run on all of XLA's threads, as a step does. The figures are cached in
`~/.cache/jaxdp/machine.json`, keyed by the CPU and the JAX version; other programs running at the same time
lower them (the load average is recorded beside).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxdp.cache import cache_dir
from jaxdp.layout import Layout
from jaxdp.planner.roofline import decode_roofline


@dataclasses.dataclass(frozen=True)
class Machine:
    """A device as the planner's roofline reads it (the attributes of `jaxdp.planner.gpus.GPU` it uses)."""

    read_bytes_per_s: float
    f32_flops_per_s: float
    bf16_flops_per_s: float
    key: str
    load_average: float
    dtype: str = "bf16"  # which dot throughput `flops_per_s` is

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.read_bytes_per_s

    @property
    def flops_per_s(self) -> float:
        return self.bf16_flops_per_s if self.dtype == "bf16" else self.f32_flops_per_s

    link_bytes_per_s = float("inf")  # one device: no collectives

    def to_dict(self) -> dict:
        return {"read_GBps": self.read_bytes_per_s / 1e9, "f32_GFLOPs": self.f32_flops_per_s / 1e9,
                "bf16_GFLOPs": self.bf16_flops_per_s / 1e9, "key": self.key, "load_average": self.load_average}


def _machine_key() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} x{os.cpu_count()} / {jax.default_backend()} / jax {jax.__version__}"


def _best(fn, *args, reps: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure() -> Machine:
    """Read bandwidth and dot throughput of the default device, now (a few seconds)."""
    gpu = jax.default_backend() == "gpu"  # a GPU reads 256 MiB in ~60 us: its launch latency would count
    x = jnp.ones((1024 if gpu else 64, 1 << 20), jnp.float32)  # 4 GiB on a GPU, 256 MiB on a CPU
    read = x.nbytes / _best(jax.jit(lambda a: a.sum(1)), x)  # rows of 4 MiB, summed along memory
    del x
    M, K, N = (8192, 8192, 8192) if gpu else (256, 2048, 4096)
    flops = {}
    for name, dt in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
        a = jnp.ones((M, K), dt)
        b = jnp.ones((K, N), dt)
        f = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32))
        flops[name] = 2 * M * K * N / _best(f, a, b)
    return Machine(read, flops["f32"], flops["bf16"], _machine_key(), os.getloadavg()[0])


def machine(refresh: bool = False) -> Machine:
    """This machine's figures: from the cache when it holds this machine's, else measured and cached."""
    path = cache_dir() / "machine.json"
    key = _machine_key()
    if not refresh and path.exists():
        raw = json.loads(path.read_text())
        if raw.get("key") == key:
            return Machine(raw["read_GBps"] * 1e9, raw["f32_GFLOPs"] * 1e9, raw["bf16_GFLOPs"] * 1e9, key,
                           raw["load_average"])
    m = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(m.to_dict(), indent=1) + "\n")
    return m


def step_floor(cfg, row_tokens: list[int], context: int, dtype: str, mach: Machine | None = None, *,
               expert_dtype: str = "bf16"):
    """The floor (`jaxdp.planner.roofline.Roofline`) of a one-device step: rows of `row_tokens` new tokens each
    (all 1: decode; all n: an extend of n-token prompts) over `context` cached tokens, weights and cache held in
    `dtype` ("float32" or "bfloat16")."""
    if len(set(row_tokens)) > 1:
        raise ValueError("step_floor prices rows of one length; give rows of equal length")
    mach = mach or machine()
    held = "fp32" if dtype in ("float32", "fp32") else "bf16"
    mach = dataclasses.replace(mach, dtype=held)
    return decode_roofline(cfg, Layout(), mach, (len(row_tokens),), context=context, expert_dtype=expert_dtype,
                           placement="jaxdp", padding="jaxdp", tokens_per_row=row_tokens[0], weight_dtype=held,
                           latency_us=0.0)


def describe(roof, step_s: float) -> str:
    """One line: the step against its floor, and what the floor is made of."""
    read = sum(t.hbm_bytes for t in roof.terms)
    flops = sum(t.flops for t in roof.terms)
    return (f"roofline: the step reads {read / 2**20:.1f} MiB and does {flops / 1e9:.2f} GFLOP; floor "
            f"{roof.ms:.2f} ms; this step {step_s * 1e3:.2f} ms = {step_s / max(roof.seconds, 1e-12):.1f}x the floor")
