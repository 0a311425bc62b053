"""The expert-distribution recorder (SGLang's `--expert-distribution-recorder-mode stat`): how many tokens each MoE
layer's router sent to each logical expert, per device, added up on the devices while recording.

Every plain step counts its own rows' router choices inside the compiled program (`MeshComm.moe` with
`count_experts`: the router's top-k ids of the valid rows, before the logical-to-physical map, each device its own
rows, so a sum over the devices counts every rank's rows once) and returns them as one small array
[devices, MoE layers, E] int32 beside its logits. The step always counts (so starting or stopping a recording never
compiles anything); while a recording runs, `ExpertRecorder.add` adds each step's array to the running total with a
small compiled add on the devices: no host round trip per step. `dump` brings the total to the host once.

On a model spanning several nodes every process runs the same compiled step, so every process must add the same
steps and gather at the same point: the actions reach the other nodes through node 0's message of the step exchange
(`jaxdp.engine.nodes.link.NodeLink.expert_record`), and every node acts on them after that exchange, before the
step it agreed on. The dump there gathers the total whole onto every device (`jaxdp.parallel.totals`, an
all-gather across the processes, compiled ahead) and reads it from the process's first device: every device's
counts, the same array as on one node.

The totals are int32: a (device, layer, expert) cell wraps past 2**31 routed tokens (about 2 billion; a device's
rows only). Speculative verify steps are not counted (their program returns no counts): a recording under
`--speculative-algorithm` sees the plain steps only.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxdp.eplb.distribution import RECORD_ACTIONS, ExpertDistribution, RecordOutcome, held_balancedness
from jaxdp.parallel.totals import compiled_gather, read_whole

__all__ = ["ExpertRecorder", "record"]


def compiled_add(counts: jax.ShapeDtypeStruct):
    """The running total's add (total, step) -> total + step for a step's counts as the step returns them, compiled now
    (before serving: a recording started while serving compiles nothing); the old total is donated."""
    return jax.jit(lambda total, step: total + step, donate_argnums=0).lower(counts, counts).compile()


def zeros(counts: jax.ShapeDtypeStruct) -> jax.Array:
    """A zero total on the devices as `counts` lays it out (a transfer from the host, no program)."""
    return jax.device_put(np.zeros(counts.shape, counts.dtype), counts.sharding)


class ExpertRecorder:
    """One model copy's recorder (its StepRunner holds it): off until `start`; `add` takes each step's counts."""

    def __init__(self, counts: jax.ShapeDtypeStruct | None = None):
        """counts: the steps' counts array (shape, dtype, sharding), for the add compiled ahead (and, when its mesh
        spans several processes, the dump's gather); None: no MoE layers."""
        self.recording = False
        self._total: jax.Array | None = None
        self._steps = 0
        self._counts = counts
        self._add = compiled_add(counts) if counts is not None else None
        spans = counts is not None and counts.sharding is not None and not counts.sharding.is_fully_addressable
        self._gather = compiled_gather(counts) if spans else None  # (several processes: every device's counts)

    def start(self) -> None:
        """Start a recording from zero (a running one starts over, as SGLang's does)."""
        self._total, self._steps, self.recording = None, 0, True

    def stop(self) -> None:
        self.recording = False

    def add(self, counts_WLE: jax.Array) -> None:
        """A step's counts [devices, layers, E] (device arrays): added to the total on the devices while recording;
        nothing is read back."""
        if not self.recording or self._add is None:
            return
        total = zeros(self._counts) if self._total is None else self._total  # (never the step's own array:
        self._total = self._add(total, counts_WLE)  # the add donates its first argument)
        self._steps += 1

    def dump(self) -> ExpertDistribution | None:
        """The recording so far (running or stopped) on the host, or None when nothing was recorded since the last
        `start` (or none ran). Across processes every process must dump at the same point (the gather is a program
        over all of them); each gets every device's counts."""
        if self._total is None:
            return None
        whole = np.asarray(self._total) if self._gather is None else read_whole(self._gather(self._total))
        return ExpertDistribution(whole.astype(np.int64), self._steps)


def record(runner, action: str) -> RecordOutcome:
    """Run a recorder action ("start", "stop", "dump") on a step runner's recorder; the engine's loop calls it
    between two steps (on several nodes every node, between the same two steps). A dump carries each layer's
    balancedness under the placement the runner holds (EP only)."""
    recorder = getattr(runner, "experts", None)
    if action not in RECORD_ACTIONS:
        return RecordOutcome(error=f"the recorder's actions are {', '.join(RECORD_ACTIONS)}, not {action!r}.")
    if recorder is None or runner.cfg.num_moe_layers == 0:
        return RecordOutcome(error="this engine's model has no MoE layers whose experts could be recorded.")
    if action == "start":
        recorder.start()
    elif action == "stop":
        recorder.stop()
    else:
        dist = recorder.dump()
        if dist is None:
            return RecordOutcome(error="nothing was recorded; call /start_expert_distribution_record and run "
                                       "requests before /dump_expert_distribution_record.")
        return RecordOutcome(dataclasses.replace(dist, balancedness=held_balancedness(runner, dist.logical_count)))
    return RecordOutcome()
