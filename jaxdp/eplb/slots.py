"""Redundant experts in the EP step: the model's expert weights as P = E + R physical slots, built on the mesh from the
logical experts by a placement's physical-to-logical map, and the placement's logical-to-physical map as data the
compiled step reads (`jaxdp.model.moe.ExpertMap`: inputs of the step like the weights, so a new map of the same
shape never compiles anything; `jaxdp.parallel.step.StepRunner.set_expert_map` swaps it between steps).

The map a layer holds has a fixed shape whatever the placement: `expert_slots_ES` [E, R + 1] (an expert's slots in
slot order; no expert can hold more than R + 1 replicas; -1 past its count) and `expert_replicas_E` [E].
Every parameter of the MoE stack that declares the "experts" axis is gathered (the dense or FP8 weights with their
block scales, the NVFP4 values with their scales and global scales), so a quantized expert moves with its scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxdp.config import ModelConfig
from jaxdp.eplb.algorithm import PlacementError
from jaxdp.eplb.distribution import DISPATCH_ALGORITHMS
from jaxdp.eplb.placement import ExpertPlacement
from jaxdp.layout import Layout, check_redundant_experts
from jaxdp.model.layers import AXES, axes_of
from jaxdp.model.moe import ExpertMap, MoE
from jaxdp.model.sharded import ShardedModel
from jaxdp.parallel.sharding import logical_spec

MAP_AXES = {"expert_slots_ES": ("layers", "expert_scores", "expert_replicas"),
            "expert_replicas_E": ("layers", "expert_scores")}


def initial_placement(cfg: ModelConfig, layout: Layout, num_redundant: int, location: str | None = None,
                      ) -> ExpertPlacement:
    """The placement a server starts from: `--init-expert-location` (a map, or a recorded load placed by the
    algorithm), else SGLang's default, the algorithm's placement of a uniform load (every expert once, the R extra
    slots to the lowest expert ids, spread over the devices)."""
    check_redundant_experts(layout, cfg.n_routed_experts, num_redundant)
    L, E, devices = cfg.num_moe_layers, cfg.n_routed_experts, layout.world
    if location:
        return ExpertPlacement.load(location, L, E, devices, num_redundant)
    return ExpertPlacement.from_load(np.ones((L, E), np.int64), num_redundant, devices)


def map_arrays(placement: ExpertPlacement) -> tuple[np.ndarray, np.ndarray]:
    """The placement's logical-to-physical map in the step's fixed shapes: slots [L, E, R + 1] (-1 past an expert's
    replica count) and replica counts [L, E], int32."""
    L, E, width = placement.logical_to_physical.shape
    slots = np.full((L, E, placement.num_redundant + 1), -1, np.int32)
    slots[:, :, :width] = placement.logical_to_physical
    return slots, placement.replica_counts.astype(np.int32)


def check_map(slots_LES: np.ndarray, replicas_LE: np.ndarray, physical_to_logical_LP: np.ndarray) -> None:
    """Refuse, in one sentence, a logical-to-physical map that the held slots cannot serve: the wrong shape, an
    expert with no replica, or a replica naming a slot that holds another expert."""
    L, P = physical_to_logical_LP.shape
    E = replicas_LE.shape[1] if replicas_LE.ndim == 2 else -1
    want = (L, E, P - E + 1)
    if slots_LES.shape != want or replicas_LE.shape != (L, E):
        raise PlacementError(f"an expert map must be slots {want} and replica counts {(L, E)} for this model, not "
                             f"{slots_LES.shape} and {replicas_LE.shape}; build it from a placement of the same "
                             f"{P - E} redundant experts.")
    if replicas_LE.min() < 1 or replicas_LE.max() > want[2]:
        raise PlacementError(f"every expert needs 1 to {want[2]} replicas in the map, not {int(replicas_LE.min())} "
                             f"to {int(replicas_LE.max())}.")
    used = np.arange(want[2])[None, None, :] < replicas_LE[:, :, None]
    slot = np.where(used, slots_LES, 0)
    if slot.min() < 0 or slot.max() >= P:
        raise PlacementError(f"the map names slot {int(slot.min() if slot.min() < 0 else slot.max())}, but the "
                             f"layers hold slots 0 .. {P - 1}.")
    held = np.take_along_axis(physical_to_logical_LP, slot.reshape(L, -1), axis=1).reshape(slot.shape)
    wrong = used & (held != np.arange(E)[None, :, None])
    if wrong.any():
        layer, expert, j = (int(i) for i in np.argwhere(wrong)[0])
        raise PlacementError(f"the map sends expert {expert} of layer {layer} to slot {int(slot[layer, expert, j])}, "
                             f"which holds expert {int(held[layer, expert, j])}; a map may only name slots holding "
                             f"its expert (weights move with --enable-eplb, jaxdp.eplb.online).")


def held_physical_to_logical(slots_LES: np.ndarray, replicas_LE: np.ndarray, num_physical: int) -> np.ndarray:
    """Which logical expert each slot holds [L, P], read back from a map that names every slot (as one built from a
    placement does); -1 for a slot the map never names."""
    L, E, S = slots_LES.shape
    out = np.full((L, num_physical), -1, np.int64)
    used = np.arange(S)[None, None, :] < replicas_LE[:, :, None]
    layer, expert, j = np.nonzero(used)
    out[layer, slots_LES[layer, expert, j]] = expert
    return out


def with_expert_slots(model: ShardedModel, placement: ExpertPlacement, layout: Layout, mesh,
                      dispatch: str = "static") -> ShardedModel:
    """The model with its MoE stack's experts held as the placement's physical slots (each parameter with the
    "experts" axis gathered by the physical-to-logical map, in its EP sharding on `mesh`) and the map as data, its
    steps choosing among an expert's replicas by `dispatch` (`--ep-dispatch-algorithm`: static or dynamic,
    `jaxdp.model.moe`). An abstract model (ShapeDtypeStructs, `plan --compile`) gets the shapes and shardings only."""
    check_dispatch_algorithm(dispatch)
    cfg = model.cfg
    check_redundant_experts(layout, cfg.n_routed_experts, placement.num_redundant)
    if placement.num_layers != cfg.num_moe_layers or placement.num_logical != cfg.n_routed_experts:
        raise PlacementError(f"the placement is for {placement.num_layers} MoE layers of {placement.num_logical} "
                             f"experts, but the model has {cfg.num_moe_layers} of {cfg.n_routed_experts}; build it "
                             f"for this model.")
    if placement.num_devices != layout.world:
        raise PlacementError(f"the placement spreads its slots over {placement.num_devices} devices but the layout "
                             f"has {layout.world}; build it for --mesh {layout.spec()}.")
    merged = model.merge()
    moe = merged.moe_layers.ffn
    if not isinstance(moe, MoE) or moe.has_expert_map:
        raise PlacementError("the model's MoE stack already holds physical expert slots; build it from the logical "
                             "experts.")
    p2l = jnp.asarray(placement.physical_to_logical)
    abstract = False
    for name, variable in list(vars(moe).items()):
        if not isinstance(variable, nnx.Variable) or "experts" not in (axes_of(variable) or ()):
            continue
        axes = tuple(axes_of(variable))
        axis = axes.index("experts")
        if axes[0] != "layers" or axis != 1:
            raise PlacementError(f"the expert parameter {name} has axes {axes}; expected the layer then the expert.")
        out = NamedSharding(mesh, logical_spec(axes, layout, name))
        value = variable.get_value()
        abstract = isinstance(value, jax.ShapeDtypeStruct)
        if abstract:  # an abstract model (plan --compile): shapes only
            gathered = jax.ShapeDtypeStruct((value.shape[0], p2l.shape[1], *value.shape[2:]), value.dtype,
                                            sharding=out)
        else:
            gathered = jax.jit(_gather_slots, out_shardings=out)(value, p2l)
        variable.set_value(gathered)  # (its metadata, the axes among them, stays)
    slots, replicas = map_arrays(placement)
    for name, value in (("expert_slots_ES", slots), ("expert_replicas_E", replicas)):
        sharding = NamedSharding(mesh, logical_spec(MAP_AXES[name], layout, name))
        held = (jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding) if abstract
                else jax.device_put(value, sharding))
        setattr(moe, name, ExpertMap(held, **{AXES: MAP_AXES[name]}))
    moe.dispatch_algorithm = dispatch  # (a static field: part of the compiled step)
    graphdef, state = nnx.split(merged)
    return ShardedModel(cfg, graphdef, state)


def check_dispatch_algorithm(dispatch: str) -> None:
    """Refuse an unknown `--ep-dispatch-algorithm` in one sentence."""
    if dispatch not in DISPATCH_ALGORITHMS:
        raise PlacementError(f"--ep-dispatch-algorithm {dispatch!r} is not built; use "
                             f"{' or '.join(DISPATCH_ALGORITHMS)}.")


def _gather_slots(w, p2l_LP):
    """w [L, E, ...] -> [L, P, ...]: slot p of layer l holds logical expert p2l[l, p]."""
    return jax.vmap(lambda w_l, idx: jnp.take(w_l, idx, axis=0))(w, p2l_LP)
