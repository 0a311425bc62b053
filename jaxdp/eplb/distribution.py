"""What the expert-distribution recorder (`jaxdp.eplb.recorder`) hands out, free of JAX: a recording on the host, an
action's outcome, each layer's balancedness under a held expert map, and the flag's check. The server's process and
the engine process's messages read these; only the recorder itself runs on the devices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

RECORDER_MODES = ("stat",)  # SGLang's others (stat_approx, per_pass, per_token) are not built
RECORD_ACTIONS = ("start", "stop", "dump")
DISPATCH_ALGORITHMS = ("static", "dynamic")  # --ep-dispatch-algorithm (jaxdp.model.moe.MoE.physical_choices)


class RecorderError(ValueError):
    """A recorder request or an EPLB flag that cannot be served; the message is one sentence saying what to
    change."""


def check_recorder_mode(mode: str | None) -> None:
    """Refuse an unknown `--expert-distribution-recorder-mode` in one sentence (None: no recorder)."""
    if mode is not None and mode not in RECORDER_MODES:
        raise RecorderError(f"--expert-distribution-recorder-mode {mode!r} is not built; use "
                            f"{' or '.join(RECORDER_MODES)} (or leave it out).")


def check_dispatch_flags(algorithm: str, num_redundant: int, location: str | None) -> None:
    """Refuse `--ep-dispatch-algorithm dynamic` without redundant experts (nothing to choose among) in one
    sentence; the value itself is argparse's choice."""
    if algorithm == "dynamic" and num_redundant < 1 and not location:
        raise RecorderError("--ep-dispatch-algorithm dynamic chooses among an expert's replicas; give "
                            "--ep-num-redundant-experts at least 1 (moe=ep).")


@dataclasses.dataclass(frozen=True)
class EplbConfig:
    """Online EPLB (`--enable-eplb`, `jaxdp.eplb.online`): a new placement every `num_iterations` steps from the
    tokens they routed, moved `layers_per_chunk` MoE layers at a time (None: all at once), SGLang's defaults."""

    num_iterations: int = 1000
    layers_per_chunk: int | None = None


def eplb_config(enable: bool, num_iterations: int | None, layers_per_chunk: int | None, moe: str,
                num_redundant: int) -> EplbConfig | None:
    """`--enable-eplb` and its two numbers, checked (a RecorderError, one sentence, names the flag to change)."""
    if not enable:
        if num_iterations is not None or layers_per_chunk is not None:
            raise RecorderError("--eplb-rebalance-num-iterations and --eplb-rebalance-layers-per-chunk need "
                                "--enable-eplb.")
        return None
    if moe != "ep" or num_redundant < 1:
        raise RecorderError("--enable-eplb moves experts between the slots of --ep-num-redundant-experts under "
                            "moe=ep; give --mesh ...,moe=ep and --ep-num-redundant-experts at least 1.")
    for flag, value in (("--eplb-rebalance-num-iterations", num_iterations),
                        ("--eplb-rebalance-layers-per-chunk", layers_per_chunk)):
        if value is not None and value < 1:
            raise RecorderError(f"{flag} must be at least 1, not {value}.")
    return EplbConfig(EplbConfig.num_iterations if num_iterations is None else num_iterations, layers_per_chunk)


@dataclasses.dataclass(frozen=True)
class ExpertDistribution:
    """A recording brought to the host: per device, MoE layer and logical expert, the tokens routed [W, L, E]; the
    steps it spans."""

    per_device: np.ndarray  # [devices, layers, experts] int64
    steps: int
    balancedness: np.ndarray | None = None  # [layers]: mean / max tokens a device under the held placement (EP)

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
        out = {"logical_count": self.logical_count.tolist(), "num_steps": self.steps,
               "per_device_logical_count": self.per_device.tolist()}
        return out | ({} if self.balancedness is None else {"balancedness": self.balancedness.tolist()})


@dataclasses.dataclass(frozen=True)
class RecordOutcome:
    """What a recorder action did on one engine: the recording (a dump), or why it was refused (one sentence)."""

    distribution: ExpertDistribution | None = None
    error: str | None = None


def held_balancedness(runner, load_LE: np.ndarray) -> np.ndarray | None:
    """Each MoE layer's balancedness (mean / max tokens a device; 1.0 for a layer without tokens) under the map the
    runner's EP step holds (an expert's tokens split evenly over the replicas the map names; without a map device d
    holds experts d * E / devices ..); None when the experts are not expert-parallel (every device holds a slice of
    every expert)."""
    if runner.layout.moe != "ep":
        return None
    L, E = load_LE.shape
    W = runner.layout.world
    held = runner.expert_map()
    slots, replicas = held if held is not None else (np.arange(E)[None, :, None].repeat(L, 0), np.ones((L, E), int))
    per_device = (E + slots.shape[2] - 1) // W
    tokens = np.zeros((L, W))
    share = np.asarray(load_LE, np.float64) / replicas
    for j in range(slots.shape[2]):
        layer, expert = np.nonzero(j < replicas)
        np.add.at(tokens, (layer, slots[layer, expert, j] // per_device), share[layer, expert])
    peak = tokens.max(1)
    return np.where(peak > 0, tokens.mean(1) / np.where(peak > 0, peak, 1.0), 1.0)
