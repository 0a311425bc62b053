"""Two-batch overlap, on the device: a rank's step as two micro-batches the model runs side by side
(`jaxdp.model.decoder.MicroBatch`), so that XLA can run one micro-batch's dispatch / combine (or gather / return)
while the other computes.

The host chooses the split row (`jaxdp.parallel.tbo_split`, at a sequence boundary, so neither micro-batch
attends the other's keys); each micro-batch holds a fixed `num_micro_rows` rows of the step (static shapes), the
rows past its own marked as padding: they write no cache entry, reach no expert and are dropped when the rows come
back together.

On a GPU the overlap is XLA's latency-hiding scheduler's to make, and two of XLA:GPU's defaults undo it
(`jaxdp.planner.tbo_report` shows both on paper): without `--xla_gpu_enable_latency_hiding_scheduler=true` the two
micro-batches' collectives are scheduled with almost no compute inside, and its collective combiners merge one
micro-batch's all-gather or reduce-scatter with the other's independent one into a single collective that waits
for both. `xla_flags` gives the XLA_FLAGS a process that splits steps needs there (the server sets them at
start-up, `jaxdp.serve`), the analytical latency estimator with them.
"""

from __future__ import annotations

import dataclasses
import os
import pkgutil
import re

import jax
import jax.numpy as jnp

from jaxdp.model.decoder import MicroBatch
from jaxdp.model.mla import AttnBatch
from jaxdp.parallel.places import GatherSpec, MeshComm

NO_SLOT = jnp.iinfo(jnp.int32).max  # a cache slot past any pool: the write is dropped

# XLA:GPU's settings for two-batch overlap: its latency-hiding scheduler with the analytical speed-of-light latency
# estimator, and no combining of collectives (a threshold of 0 bytes), so each micro-batch's collectives stay its own
GPU_FLAGS = (("xla_gpu_enable_latency_hiding_scheduler", "true"),
             ("xla_gpu_enable_analytical_sol_latency_estimator", "true"),
             ("xla_gpu_all_gather_combine_threshold_bytes", "0"),
             ("xla_gpu_reduce_scatter_combine_threshold_bytes", "0"),
             ("xla_gpu_all_reduce_combine_threshold_bytes", "0"))
GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def xla_flags(current: str, platform: str) -> str:
    """XLA_FLAGS for a process that runs two-batch overlap on `platform` ("cuda", "rocm", "gpu", "cpu", ...):
    on a GPU, `current` plus each of `GPU_FLAGS` it does not set itself (a flag the user set keeps the user's
    value); elsewhere `current` unchanged."""
    if platform not in GPU_PLATFORMS:
        return current
    have = set(re.findall(r"--(\w+)", current))
    extra = [f"--{name}={value}" for name, value in GPU_FLAGS if name not in have]
    return " ".join([current.strip(), *extra]).strip()


def platform_at_start() -> str:
    """The platform JAX will start on, read before its backends start: the first of `jax_platforms`
    (JAX_PLATFORMS) where set, else "cuda" / "rocm" where such a plugin is installed (JAX prefers it), else
    "cpu"."""
    chosen = (jax.config.jax_platforms or "").split(",")[0].strip().lower()
    if chosen:
        return chosen
    try:
        import jax_plugins
    except ImportError:
        return "cpu"
    names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    return next((p for p in ("cuda", "rocm") if any(n.startswith(f"xla_{p}") for n in names)), "cpu")


def set_xla_flags(environ=os.environ, platform: str | None = None) -> str:
    """Put `xla_flags` into `environ`'s XLA_FLAGS (before JAX's backends start, which is when XLA reads them);
    returns the value set."""
    flags = xla_flags(environ.get("XLA_FLAGS", ""), platform_at_start() if platform is None else platform)
    if flags:
        environ["XLA_FLAGS"] = flags
    return flags


def micro_batches(batch: AttnBatch, valid_T: jax.Array, split: jax.Array, num_micro_rows: int, absorbed: bool,
                  comm: MeshComm) -> tuple[MicroBatch, MicroBatch]:
    """The step's rows [0, split) and [split, T) as two micro-batches of `num_micro_rows` rows each. A decode step's
    row t is its sequence t, so each micro-batch takes its rows' page tables and lengths along (T == B); a prompt
    step's micro-batches keep every sequence's and select by `seq_T`. Their comms are `comm` at the micro-batch's
    row count, gathering MAX_LEN (no SUM_LEN offsets to agree on per micro-batch)."""
    T, M = valid_T.shape[0], num_micro_rows
    m = jnp.arange(M, dtype=jnp.int32)
    gather = GatherSpec("max_len", comm.gather.dp, comm.gather.tp)
    micro_comm = dataclasses.replace(comm, gather=gather, num_rows=M)
    out = []
    for start, end in ((0, split), (split, T)):
        rows = start + m
        own = rows < end
        rows_M = jnp.where(own, rows, T)

        def take(a, fill, rows_M=rows_M):
            return jnp.take(a, rows_M, axis=0, mode="fill", fill_value=fill)

        valid_M = take(valid_T, False)
        positions, slots = take(batch.positions_T, 0), take(batch.slots_T, NO_SLOT)
        if absorbed:
            seq = jnp.where(valid_M, m, M)
            sub = AttnBatch(positions, seq, slots, take(batch.page_table_BN, 0), take(batch.seq_lens_B, 0))
        else:
            seq = take(batch.seq_T, batch.page_table_BN.shape[0])
            sub = AttnBatch(positions, seq, slots, batch.page_table_BN, batch.seq_lens_B)
        out.append(MicroBatch(rows_M, valid_M, sub, micro_comm))
    return out[0], out[1]
