"""Expert placement as data: which logical expert each physical expert slot of each MoE layer holds, under expert
parallelism with R redundant experts (E + R slots, P / devices on each device, a hot expert on several devices).

`ExpertPlacement` holds the maps as numpy arrays (the compiled step is to read them as device arrays, so that a new
placement is new data and never a new program). It is built from the EPLB algorithm (`from_load`), from the trivial
placement (`identity`: slot p holds expert p mod E, which for R = 0 is today's EP layout, device d holding experts
d * E/devices ..), from a map (`from_physical_to_logical`), or from a file (`load`, what `--init-expert-location`
names): JSON or .npz holding either `logical_count` (a recorded distribution [L, E], from which the algorithm
computes the placement) or `physical_to_logical_map` (a placement [L, P]). Every bad input is refused with a
`PlacementError` of one sentence.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxdp.eplb.algorithm import (
    PlacementError,
    balancedness,
    check_load,
    check_sizes,
    device_tokens,
    maps_of,
    rebalance,
)

LOAD_KEY = "logical_count"  # a recorded distribution [L, E] (SGLang's name)
MAP_KEY = "physical_to_logical_map"  # a placement [L, P] (SGLang's name)
FILE_SUFFIXES = (".json", ".npz")


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """The placement of E logical experts in P physical slots, per MoE layer, over `num_devices` devices (slot p
    is on device p // (P / devices)). Build it with the class methods, which check it."""

    physical_to_logical: np.ndarray  # int32 [L, P]
    logical_to_physical: np.ndarray  # int32 [L, E, max replicas], -1 past an expert's replica count
    replica_counts: np.ndarray  # int32 [L, E]
    num_devices: int

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.replica_counts.shape[1]

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def slots_per_device(self) -> int:
        return self.num_physical // self.num_devices

    # ---- building one ----------------------------------------------------------------------------------------

    @classmethod
    def from_physical_to_logical(cls, phy_to_log_LP, num_logical: int, num_devices: int) -> ExpertPlacement:
        """The placement a map [L, P] describes; refused (one sentence) when it has the wrong shape, names an
        expert that does not exist, leaves an expert unplaced or does not split over the devices."""
        phy_to_log = np.asarray(phy_to_log_LP)
        if phy_to_log.ndim != 2 or phy_to_log.shape[0] < 1:
            raise PlacementError(f"a physical-to-logical map must be a [layers, physical slots] array, not one of "
                                 f"shape {phy_to_log.shape}.")
        if phy_to_log.size and not np.issubdtype(phy_to_log.dtype, np.integer):
            if not np.issubdtype(phy_to_log.dtype, np.floating) or np.any(phy_to_log != np.round(phy_to_log)):
                raise PlacementError(f"a physical-to-logical map must hold integer expert ids, not "
                                     f"{phy_to_log.dtype} values.")
        phy_to_log = phy_to_log.astype(np.int64)
        check_sizes(num_logical, phy_to_log.shape[1], 1, 1, num_devices)
        if phy_to_log.min() < 0 or phy_to_log.max() >= num_logical:
            bad = int(phy_to_log.min() if phy_to_log.min() < 0 else phy_to_log.max())
            raise PlacementError(f"the map names expert {bad}, but the model's experts are 0 .. {num_logical - 1}.")
        maps = maps_of(phy_to_log, num_logical)
        if np.any(maps.replica_counts == 0):
            layer, expert = (int(i) for i in np.argwhere(maps.replica_counts == 0)[0])
            raise PlacementError(f"the map never places expert {expert} of layer {layer}; every expert needs at "
                                 f"least one slot.")
        return cls._of(maps.physical_to_logical, maps.logical_to_physical, maps.replica_counts, num_devices)

    @classmethod
    def identity(cls, num_layers: int, num_logical: int, num_devices: int, num_redundant: int = 0) -> ExpertPlacement:
        """The trivial placement: slot p holds expert p mod E (R = 0: device d holds experts d * E/devices ..)."""
        if num_layers < 1:
            raise PlacementError(f"a placement needs at least one MoE layer, not {num_layers}.")
        check_sizes(num_logical, num_logical + num_redundant, 1, 1, num_devices)
        row = np.arange(num_logical + num_redundant) % num_logical
        return cls.from_physical_to_logical(np.tile(row, (num_layers, 1)), num_logical, num_devices)

    @classmethod
    def from_load(cls, load_LE, num_redundant: int, num_devices: int, num_groups: int = 1, num_nodes: int = 1,
                  policy: str = "auto") -> ExpertPlacement:
        """The EPLB algorithm's placement for a load [L, E] with `num_redundant` extra slots."""
        load = check_load(load_LE)
        maps = rebalance(load, load.shape[1] + num_redundant, num_groups, num_nodes, num_devices, policy)
        return cls._of(maps.physical_to_logical, maps.logical_to_physical, maps.replica_counts, num_devices)

    @classmethod
    def load(cls, path: str | Path, num_layers: int, num_logical: int, num_devices: int, num_redundant: int = 0,
             num_groups: int = 1, num_nodes: int = 1, policy: str = "auto") -> ExpertPlacement:
        """`--init-expert-location PATH`: a JSON or .npz file holding `logical_count` [L, E] (a recorded
        distribution, placed by the algorithm with `num_redundant` extra slots) or `physical_to_logical_map`
        [L, P] (a placement, whose P must be num_logical + num_redundant)."""
        data = read_location_file(path)
        if LOAD_KEY in data:
            load = check_load(data[LOAD_KEY], num_logical)
            if load.shape[0] != num_layers:
                raise PlacementError(f"{path} records {load.shape[0]} MoE layers but the model has {num_layers}; "
                                     f"record it with this model.")
            return cls.from_load(load, num_redundant, num_devices, num_groups, num_nodes, policy)
        placement = cls.from_physical_to_logical(data[MAP_KEY], num_logical, num_devices)
        if placement.num_layers != num_layers:
            raise PlacementError(f"{path} places {placement.num_layers} MoE layers but the model has {num_layers}; "
                                 f"write a map for this model.")
        if placement.num_redundant != num_redundant:
            raise PlacementError(f"{path} has {placement.num_physical} slots a layer ({placement.num_redundant} "
                                 f"redundant experts) but {num_redundant} redundant experts were asked for; set "
                                 f"--ep-num-redundant-experts {placement.num_redundant}.")
        return placement

    @classmethod
    def _of(cls, phy_to_log, log_to_phy, counts, num_devices: int) -> ExpertPlacement:
        return cls(np.asarray(phy_to_log, np.int32), np.asarray(log_to_phy, np.int32), np.asarray(counts, np.int32),
                   num_devices)

    # ---- using one -------------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the map as `--init-expert-location` reads it (JSON or .npz, by the suffix)."""
        path = Path(path)
        if path.suffix == ".npz":
            np.savez(path, **{MAP_KEY: self.physical_to_logical})
        elif path.suffix == ".json":
            path.write_text(json.dumps({MAP_KEY: self.physical_to_logical.tolist()}))
        else:
            raise PlacementError(f"{path} is neither .json nor .npz; name the placement file with one of those.")

    def device_of_slot(self) -> np.ndarray:
        """[P]: the device each physical slot is on."""
        return np.arange(self.num_physical) // self.slots_per_device

    def device_tokens(self, load_LE) -> np.ndarray:
        """Tokens each device's experts receive [L, devices] for a load [L, E], under static dispatch."""
        load = self._layer_load(load_LE)
        return device_tokens(load, self.physical_to_logical, self.replica_counts, self.num_devices)

    def balancedness(self, load_LE) -> np.ndarray:
        """Mean / max tokens per device, per layer [L], for a load [L, E]."""
        load = self._layer_load(load_LE)
        return balancedness(load, self.physical_to_logical, self.replica_counts, self.num_devices)

    def dispatch(self, layer: int, expert_ids_TK) -> np.ndarray:
        """Static dispatch of one layer's routed choices [T, K] (logical ids; E is the padding sentinel): the
        physical slot of each (row, choice), the j-th pair (row-major) choosing expert e going to e's replica
        j mod count, so an expert's pairs split evenly over its replicas (they differ by at most one). The
        sentinel maps to P, one past the last slot. The numpy reference for the step's on-device version."""
        if not 0 <= layer < self.num_layers:
            raise PlacementError(f"layer {layer} is not one of the placement's MoE layers 0 .. "
                                 f"{self.num_layers - 1}.")
        ids = np.asarray(expert_ids_TK)
        flat = ids.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() > self.num_logical):
            raise PlacementError(f"expert ids must be 0 .. {self.num_logical} (the last one the padding sentinel).")
        real = flat < self.num_logical
        expert = np.where(real, flat, 0)
        onehot = (expert[:, None] == np.arange(self.num_logical)[None, :]) & real[:, None]
        occurrence = np.take_along_axis(np.cumsum(onehot, axis=0), expert[:, None], axis=1)[:, 0] - 1
        replica = occurrence % self.replica_counts[layer][expert]
        slot = self.logical_to_physical[layer][expert, replica]
        return np.where(real, slot, self.num_physical).reshape(ids.shape)

    def _layer_load(self, load_LE) -> np.ndarray:
        load = check_load(load_LE, self.num_logical)
        if load.shape[0] != self.num_layers:
            raise PlacementError(f"the load has {load.shape[0]} layers but the placement has {self.num_layers}.")
        return load


def read_location_file(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of an `--init-expert-location` file: exactly one of `logical_count` or `physical_to_logical_map`."""
    path = Path(path)
    if path.suffix not in FILE_SUFFIXES:
        raise PlacementError(f"--init-expert-location {path} is neither .json nor .npz; give a JSON or .npz file "
                             f"holding {LOAD_KEY} or {MAP_KEY}.")
    if not path.is_file():
        raise PlacementError(f"--init-expert-location {path} does not exist; give the path of a placement file.")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except (ValueError, OSError) as e:
            raise PlacementError(f"{path} could not be read as JSON ({e}); write it again.") from None
        if not isinstance(raw, dict):
            raise PlacementError(f"{path} holds a JSON {type(raw).__name__}, not an object with {LOAD_KEY} or "
                                 f"{MAP_KEY}.")
        data = {}
        for key in set(raw) & {LOAD_KEY, MAP_KEY}:
            try:
                data[key] = np.asarray(raw[key])
            except ValueError:
                raise PlacementError(f"{path}'s {key} is not a rectangular array; write one row of equal length "
                                     f"for each MoE layer.") from None
    else:
        try:
            with np.load(path, allow_pickle=False) as npz:
                data = {k: npz[k] for k in npz.files if k in (LOAD_KEY, MAP_KEY)}
        except (ValueError, OSError, EOFError):
            raise PlacementError(f"{path} could not be read as an .npz file of arrays; write it again with "
                                 f"numpy.savez.") from None
    if len(data) != 1:
        raise PlacementError(f"{path} must hold exactly one of {LOAD_KEY} (a recorded distribution [layers, "
                             f"experts]) or {MAP_KEY} (a placement [layers, slots]), and it holds "
                             f"{'both' if data else 'neither'}.")
    return data
