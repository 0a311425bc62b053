"""The expert-distribution recorder (SGLang's `--expert-distribution-recorder-mode stat`): how many tokens each MoE
layer's router sent to each logical expert, per device, added up on the devices while recording.

Every plain step counts its own rows' router choices inside the compiled program (`MeshComm.moe` with
`count_experts`: the router's top-k ids of the valid rows, before the logical-to-physical map, each device its own
rows, so a sum over the devices counts every rank's rows once) and returns them as one small array
[devices, MoE layers, E] int32 beside its logits. The step always counts (so starting or stopping a recording never
compiles anything); while a recording runs, `ExpertRecorder.add` adds each step's array to the running total with a
small compiled add on the devices: no host round trip per step. `dump` brings the total to the host once.

The totals are int32: a (device, layer, expert) cell wraps past 2**31 routed tokens (about 2 billion; a device's
rows only). Speculative verify steps are not counted (their program returns no counts): a recording under
`--speculative-algorithm` sees the plain steps only.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

RECORDER_MODES = ("stat",)  # SGLang's others (stat_approx, per_pass, per_token) are not built


class RecorderError(ValueError):
    """A recorder request that cannot be served; the message is one sentence saying what to change."""


def check_recorder_mode(mode: str | None) -> None:
    """Refuse an unknown `--expert-distribution-recorder-mode` in one sentence (None: no recorder)."""
    if mode is not None and mode not in RECORDER_MODES:
        raise RecorderError(f"--expert-distribution-recorder-mode {mode!r} is not built; use "
                            f"{' or '.join(RECORDER_MODES)} (or leave it out).")


@dataclasses.dataclass(frozen=True)
class ExpertDistribution:
    """A recording brought to the host: per device, MoE layer and logical expert, the tokens routed [W, L, E]; the
    steps it spans."""

    per_device: np.ndarray  # [devices, layers, experts] int64
    steps: int

    @property
    def logical_count(self) -> np.ndarray:
        """[layers, experts]: every device's rows (what `--init-expert-location` reads as `logical_count`)."""
        return self.per_device.sum(0)

    def per_rank(self, tp: int) -> np.ndarray:
        """[dp ranks, layers, experts]: a rank's rows are its tp devices' (devices are numbered rank * tp + t)."""
        W, L, E = self.per_device.shape
        return self.per_device.reshape(W // tp, tp, L, E).sum(1)

    def to_json(self) -> dict:
        """SGLang's stat dump in JSON: `logical_count` [layers, experts], with the steps and the per-device counts."""
        return {"logical_count": self.logical_count.tolist(), "num_steps": self.steps,
                "per_device_logical_count": self.per_device.tolist()}


@jax.jit
def _add(total, step):
    return total + step


class ExpertRecorder:
    """One model copy's recorder (its StepRunner holds it): off until `start`; `add` takes each step's counts."""

    def __init__(self):
        self.recording = False
        self._total: jax.Array | None = None
        self._steps = 0

    def start(self) -> None:
        """Start a recording from zero (a running one starts over, as SGLang's does)."""
        self._total, self._steps, self.recording = None, 0, True

    def stop(self) -> None:
        self.recording = False

    def add(self, counts_WLE: jax.Array) -> None:
        """A step's counts [devices, layers, E] (device arrays): added to the total on the devices while recording;
        nothing is read back."""
        if not self.recording or counts_WLE.size == 0:
            return
        self._total = counts_WLE if self._total is None else _add(self._total, counts_WLE)
        self._steps += 1

    def dump(self, read=np.asarray) -> ExpertDistribution | None:
        """The recording so far (running or stopped) on the host, or None when nothing was recorded since the last
        `start` (or none ran). `read`: how a device array comes back (across processes, the runner's
        `local_values`: this process's devices only)."""
        if self._total is None:
            return None
        return ExpertDistribution(np.asarray(read(self._total), np.int64), self._steps)
