"""Online EPLB (SGLang's `--enable-eplb`, `--eplb-rebalance-num-iterations N`, `--eplb-rebalance-layers-per-chunk C`):
every N steps a new placement from the tokens the steps routed, and the expert weights moved to it between steps,
C MoE layers at a time, while requests keep running.

- **The load.** The runner's steps return their routed tokens per device, layer and logical expert
  (`jaxdp.eplb.recorder`); `Rebalancer.after_step` adds each step's array into a window on the devices (a small
  compiled add; nothing read back per step). After N steps the window is summed over the devices into one array whole
  on every device (`jaxdp.parallel.totals`: an all-reduce, across the nodes when the model spans several) and read
  once: every device's rows counted once, the same numbers on every node.
- **The placement.** The EPLB algorithm (`ExpertPlacement.from_load`, global policy with one group on one node) places
  the E experts in the same P = E + R slots. Every process computing it from the same load gets the same map (ties go
  to the lowest index): on several nodes every node decides alike, with no exchange of the map.
- **Several nodes.** Every node's engine loop runs the same steps (the ranks' agreement), and the rebalancer acts only
  right after a step: it counts that step, decides after the N-th, and moves one chunk after each step while a
  rebalance is under way. So every process issues the same programs (steps, sums, moves) in the same order, as a
  program spanning processes needs, whatever idle iterations each loop makes.
- **The move.** The layers are moved in chunks of C (all at once by default, SGLang's default), one chunk between two
  steps. One compiled program per chunk size (C, and the last chunk's when C does not divide the layers; compiled when
  the rebalancer is built, before serving) takes every parameter of the MoE stack that declares the "experts" axis
  (the dense or block-FP8 weights with their block scales, NVFP4 values with their scales and global scales), the
  map arrays and the chunk's first layer (a traced number: no program per chunk), and returns them with the chunk's
  slots gathered from where their experts sit now (a slot that keeps its expert reads itself) and the chunk's map
  replaced. The weights and the map of a layer change in the same program, between two steps, so a step sees either
  the old layer or the new one, never half of it. The old arrays are donated: the move holds one chunk's slots
  twice, not the stack. On the mesh the gather of a chunk's slots crosses devices as XLA's SPMD partitioner lays it
  out (an all-gather of the chunk's experts, then each device keeps its own slots).

Not built: the hierarchical policy's groups and nodes (online it is the global policy), and moving only the slots
that change (the chunk's every slot is rewritten).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxdp.eplb.algorithm import PlacementError
from jaxdp.eplb.distribution import EplbConfig
from jaxdp.eplb.placement import ExpertPlacement
from jaxdp.eplb.recorder import compiled_add, zeros
from jaxdp.eplb.slots import held_physical_to_logical, map_arrays
from jaxdp.model.layers import axes_of
from jaxdp.parallel.totals import compiled_device_sum, read_whole

log = logging.getLogger("jaxdp.eplb")

MAP_NAMES = ("expert_slots_ES", "expert_replicas_E")


@dataclasses.dataclass
class Rebalance:
    """One rebalance under way: the placement moved to and the chunks of layers still to move."""

    placement: ExpertPlacement
    chunks: list[tuple[int, int]]  # (first layer, layers)
    load: np.ndarray  # [L, E] the window's tokens it was placed for
    balancedness_before: np.ndarray  # [L] the window's under the old placement
    balancedness_after: np.ndarray  # [L] the window's under the new one


class Rebalancer:
    """Online EPLB on one StepRunner whose MoE stack holds physical slots and a map (`--ep-num-redundant-experts`).
    `after_step()` after every step: it adds the step's routed tokens to the window, starts a rebalance every
    `num_iterations` steps and moves one chunk of layers per call while one is under way."""

    def __init__(self, runner, config: EplbConfig):
        held = runner.expert_map()
        if held is None:
            raise PlacementError("--enable-eplb moves experts between the slots of --ep-num-redundant-experts under "
                                 "moe=ep; give --ep-num-redundant-experts at least 1.")
        self.runner, self.config = runner, config
        L, E, S = held[0].shape
        self.num_layers, self.num_logical, self.num_physical = L, E, E + S - 1
        self.devices = runner.layout.world
        chunk = config.layers_per_chunk or L
        if not 1 <= chunk:
            raise PlacementError(f"--eplb-rebalance-layers-per-chunk must be at least 1, not {chunk}.")
        self.chunk = min(chunk, L)
        self.chunk_sizes = sorted({self.chunk, L % self.chunk} - {0})
        self.steps = 0  # since the last rebalance began
        self.rebalances: list[Rebalance] = []  # (the last ones: the benchmark's and the tests' record)
        self.pending: Rebalance | None = None
        self.move_seconds: list[float] = []  # each chunk's move, dispatched and finished
        self._window = None
        self._seen = None
        moe = self._moe()
        self._names = [n for n, v in moe.items() if isinstance(v, nnx.Variable) and n not in MAP_NAMES
                       and "experts" in (axes_of(v) or ())]
        self._add = compiled_add(runner.counts_spec)
        self._sum = compiled_device_sum(runner.counts_spec)  # the window over the devices, whole on every node
        self._everywhere = NamedSharding(runner.mesh, PartitionSpec())
        self._moves = {c: self._compile_move(c) for c in self.chunk_sizes}

    # ---- the runner's MoE stack ----------------------------------------------------------------------------
    def _moe(self):
        return self.runner.state["moe_layers"]["ffn"]

    def _arrays(self):
        moe = self._moe()
        return ({n: moe[n].get_value() for n in self._names}, moe[MAP_NAMES[0]].get_value(),
                moe[MAP_NAMES[1]].get_value())

    def _compile_move(self, size: int):
        params, slots, replicas = self._arrays()

        def move(params, slots, replicas, src_CP, new_slots_CES, new_replicas_CE, first):
            out = {}
            for name, w in params.items():
                chunk = jax.lax.dynamic_slice_in_dim(w, first, size, axis=0)
                moved = jax.vmap(lambda w_l, src_P: jnp.take(w_l, src_P, axis=0))(chunk, src_CP)
                out[name] = jax.lax.dynamic_update_slice_in_dim(w, moved.astype(w.dtype), first, axis=0)
            slots = jax.lax.dynamic_update_slice_in_dim(slots, new_slots_CES, first, axis=0)
            replicas = jax.lax.dynamic_update_slice_in_dim(replicas, new_replicas_CE, first, axis=0)
            return out, slots, replicas

        def spec(a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

        shardings = ({n: w.sharding for n, w in params.items()}, slots.sharding, replicas.sharding)
        S, everywhere = slots.shape[2], self._everywhere
        args = (jax.tree.map(spec, params), spec(slots), spec(replicas),
                jax.ShapeDtypeStruct((size, self.num_physical), jnp.int32, sharding=everywhere),
                jax.ShapeDtypeStruct((size, self.num_logical, S), jnp.int32, sharding=everywhere),
                jax.ShapeDtypeStruct((size, self.num_logical), jnp.int32, sharding=everywhere),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=everywhere))
        return jax.jit(move, donate_argnums=(0, 1, 2), out_shardings=shardings).lower(*args).compile()

    # ---- between steps -------------------------------------------------------------------------------------
    def after_step(self) -> None:
        """After a step: count its tokens; every `num_iterations` steps decide a new placement; move one chunk while a
        rebalance is under way. Nothing happens when no step ran since the last call (an idle iteration), so every
        node acts after the same steps."""
        counts = self.runner.last_expert_counts
        if counts is None or counts is self._seen:
            return
        self._seen = counts
        self._window = self._add(zeros(self.runner.counts_spec) if self._window is None else self._window, counts)
        self.steps += 1
        if self.pending is not None:
            self.move_next_chunk()
        elif self.steps >= self.config.num_iterations:
            self.start(read_whole(self._sum(self._window)).astype(np.int64))
            self._window, self.steps = None, 0

    def reset(self) -> None:
        """Forget the tokens counted so far: the next rebalance is decided from the steps after this."""
        self._window, self.steps = None, 0

    def held_placement(self) -> ExpertPlacement:
        slots, replicas = self.runner.expert_map()
        p2l = held_physical_to_logical(slots, replicas, self.num_physical)
        return ExpertPlacement.from_physical_to_logical(p2l, self.num_logical, self.devices)

    def start(self, load_LE: np.ndarray) -> Rebalance:
        """Decide the placement of `load_LE` [L, E] and queue its chunks (the next `after_step` calls move them)."""
        old = self.held_placement()
        new = ExpertPlacement.from_load(load_LE, self.num_physical - self.num_logical, self.devices)
        chunks = [(first, min(self.chunk, self.num_layers - first)) for first in range(0, self.num_layers, self.chunk)]
        self.pending = Rebalance(new, chunks, load_LE, old.balancedness(load_LE), new.balancedness(load_LE))
        self.rebalances = [*self.rebalances[-7:], self.pending]
        log.info("eplb: rebalance from %d routed tokens, placement %08x -> %08x, balancedness %s -> %s",
                 int(load_LE.sum()), placement_digest(old), placement_digest(new),
                 _rounded(self.pending.balancedness_before), _rounded(self.pending.balancedness_after))
        return self.pending

    def move_next_chunk(self) -> None:
        """Move the next chunk of the rebalance under way: its weights and its map, in one program."""
        t0 = time.perf_counter()
        first, size = self.pending.chunks.pop(0)
        new = self.pending.placement
        old_p2l = held_physical_to_logical(*self.runner.expert_map(), self.num_physical)
        src = source_slots(old_p2l[first:first + size], new.physical_to_logical[first:first + size],
                           self.num_physical // self.devices)
        slots, replicas = map_arrays(new)
        params, held_slots, held_replicas = self._arrays()
        def put(a):  # (host arrays onto every device of every process as the program takes them: no program)
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, self._everywhere, lambda index: a[index])

        out, held_slots, held_replicas = self._moves[size](
            params, held_slots, held_replicas, put(src), put(np.ascontiguousarray(slots[first:first + size])),
            put(np.ascontiguousarray(replicas[first:first + size])), put(np.int32(first)))
        moe = self._moe()
        for name, value in out.items():
            moe[name].set_value(value)
        moe[MAP_NAMES[0]].set_value(held_slots)
        moe[MAP_NAMES[1]].set_value(held_replicas)
        jax.block_until_ready(held_replicas)
        self.move_seconds.append(time.perf_counter() - t0)
        if not self.pending.chunks:
            self.pending = None


def placement_digest(placement: ExpertPlacement) -> int:
    """A CRC-32 of a placement's physical-to-logical map (int32): equal on every node that decided alike (the log)."""
    return zlib.crc32(np.ascontiguousarray(placement.physical_to_logical, np.int32).tobytes())


def _rounded(values: np.ndarray) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def source_slots(old_p2l_CP: np.ndarray, new_p2l_CP: np.ndarray, slots_per_device: int) -> np.ndarray:
    """For each new slot of each layer [C, P], the slot it reads its expert from now: itself when it already holds
    that expert, else a slot holding it on the same device, else the first slot holding it."""
    C, P = new_p2l_CP.shape
    src = np.empty((C, P), np.int32)
    device = np.arange(P) // slots_per_device
    for layer in range(C):
        for p in range(P):
            e = new_p2l_CP[layer, p]
            holders = np.flatnonzero(old_p2l_CP[layer] == e)
            if holders.size == 0:
                raise PlacementError(f"no slot of layer {layer} holds expert {e}; the held map is not a placement.")
            near = holders[device[holders] == device[p]]
            src[layer, p] = p if old_p2l_CP[layer, p] == e else (near[0] if near.size else holders[0])
    return src
