"""DeepSeek's expert-parallel load balancing (EPLB) placement algorithm, written from its published description, in
numpy: where to put E logical experts, some of them copied, in P = E + R physical expert slots spread evenly over
the GPUs, so that the tokens each GPU's experts receive are as even as possible.

The three steps, each a greedy heuristic (ties always go to the lowest index, so every node computes the same map):

1. **Groups to nodes** (`balanced_packing`): the expert groups of group-limited routing are packed to the nodes,
   heaviest group first, each to the lightest node that still has room for a group; every node gets G / nodes
   groups, so a token's chosen groups, and their experts, stay on few nodes.
2. **Replicas to the heaviest** (`replicate`): inside each node, the node's P / nodes slots are first given one to
   each of its experts, then each spare slot to the expert whose load per replica is the largest at that moment.
3. **Physical experts to GPUs** (`balanced_packing` again): inside each node, the replicas (each carrying its
   expert's load divided by its replica count) are packed to the node's GPUs, heaviest first, each to the lightest
   GPU with a free slot; every GPU gets exactly P / GPUs slots.

`rebalance` runs this hierarchical policy when the node count divides the group count, and otherwise the global
policy: the same steps with one group and one node (replicas chosen over all experts, packed over all GPUs).

Shapes: L layers, E logical experts, P physical slots (E + R), G expert groups. Outputs: `physical_to_logical`
[L, P] (the logical expert each slot holds; slot p is on GPU p // (P / GPUs)), `logical_to_physical`
[L, E, max replicas] (each expert's slots in slot order, padded with -1), `replica_counts` [L, E].

`device_tokens` and `balancedness` measure a placement against a load under static dispatch (each (row, choice)
goes to one replica of its expert, an expert's tokens split evenly over its replicas): balancedness is mean / max
tokens per GPU, per layer (1.0 is perfect; a layer with no tokens counts as 1.0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

POLICIES = ("auto", "hierarchical", "global")


class PlacementError(ValueError):
    """A load, a map or a size the placement cannot be built from; the message is one sentence saying what to
    change."""


@dataclasses.dataclass(frozen=True)
class Maps:
    """The algorithm's result: the three maps of one placement (int64 numpy arrays)."""

    physical_to_logical: np.ndarray  # [L, P]
    logical_to_physical: np.ndarray  # [L, E, max replicas], -1 past an expert's replica count
    replica_counts: np.ndarray  # [L, E], every entry >= 1


def balanced_packing(weight_XN: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the N items of each row into `num_packs` packs of exactly N / num_packs items, balancing the packs'
    weights: items in decreasing weight (ties: lower index first), each to the lightest pack that still has room
    (ties: lower pack). Returns (pack of each item [X, N], its position inside the pack [X, N])."""
    rows, n = weight_XN.shape
    per_pack = n // num_packs
    pack_XN = np.empty((rows, n), np.int64)
    rank_XN = np.empty((rows, n), np.int64)
    for x in range(rows):
        loads = np.zeros(num_packs)
        filled = np.zeros(num_packs, np.int64)
        for item in np.argsort(-weight_XN[x], kind="stable"):
            open_loads = np.where(filled < per_pack, loads, np.inf)
            pack = int(np.argmin(open_loads))
            pack_XN[x, item], rank_XN[x, item] = pack, filled[pack]
            loads[pack] += weight_XN[x, item]
            filled[pack] += 1
    return pack_XN, rank_XN


def replicate(weight_XN: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Give `num_slots` >= N slots to the N items of each row: one each (slot i holds item i), then every spare
    slot to the item with the largest weight per replica at that moment (ties: lower index). Returns (item of each
    slot [X, S], replica count of each item [X, N])."""
    rows, n = weight_XN.shape
    item_XS = np.empty((rows, num_slots), np.int64)
    item_XS[:, :n] = np.arange(n)
    count_XN = np.ones((rows, n), np.int64)
    for x in range(rows):
        for slot in range(n, num_slots):
            item = int(np.argmax(weight_XN[x] / count_XN[x]))
            item_XS[x, slot] = item
            count_XN[x, item] += 1
    return item_XS, count_XN


def check_sizes(num_logical: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    """Refuse sizes no placement fits, in one sentence naming what to change."""
    for name, value in (("experts", num_logical), ("physical slots", num_physical), ("groups", num_groups),
                        ("nodes", num_nodes), ("GPUs", num_gpus)):
        if value < 1:
            raise PlacementError(f"the number of {name} must be at least 1, not {value}.")
    if num_physical < num_logical:
        raise PlacementError(f"{num_physical} physical slots cannot hold {num_logical} experts once each; use at "
                             f"least {num_logical} slots (R >= 0 redundant experts).")
    if num_logical % num_groups:
        raise PlacementError(f"{num_logical} experts do not split into {num_groups} equal groups; use a group "
                             f"count that divides {num_logical} (the model's n_group).")
    if num_gpus % num_nodes:
        raise PlacementError(f"{num_gpus} GPUs do not split evenly over {num_nodes} nodes; use a node count that "
                             f"divides {num_gpus}.")
    if num_physical % num_gpus:
        raise PlacementError(f"{num_physical} physical slots do not split evenly over {num_gpus} GPUs; use a "
                             f"redundant expert count that makes {num_logical} + R a multiple of {num_gpus}.")


def check_load(load_LE: np.ndarray, num_logical: int | None = None) -> np.ndarray:
    """The load as float64 [L, E] with finite non-negative entries, or a PlacementError saying what is wrong."""
    load = np.asarray(load_LE)
    if load.ndim != 2 or load.shape[0] < 1 or load.shape[1] < 1:
        raise PlacementError(f"an expert load must be a [layers, experts] array, not one of shape {load.shape}.")
    if num_logical is not None and load.shape[1] != num_logical:
        raise PlacementError(f"the load has {load.shape[1]} experts a layer but the model has {num_logical}; "
                             f"record it with this model.")
    if not np.issubdtype(load.dtype, np.number) or np.issubdtype(load.dtype, np.complexfloating):
        raise PlacementError(f"an expert load must hold real numbers, not {load.dtype}.")
    load = load.astype(np.float64)
    if not np.all(np.isfinite(load)) or np.any(load < 0):
        raise PlacementError("an expert load must hold finite token counts of at least 0.")
    return load


def choose_policy(num_groups: int, num_nodes: int, policy: str = "auto") -> str:
    """'hierarchical' when the nodes divide the groups (or it is asked for and possible), else 'global'."""
    if policy not in POLICIES:
        raise PlacementError(f"unknown EPLB policy {policy!r}; use one of {', '.join(POLICIES)}.")
    divides = num_groups % num_nodes == 0
    if policy == "hierarchical" and not divides:
        raise PlacementError(f"the hierarchical policy packs whole groups to nodes, but {num_groups} groups do "
                             f"not split over {num_nodes} nodes; use the global policy or a node count that "
                             f"divides {num_groups}.")
    if policy == "auto":
        return "hierarchical" if divides else "global"
    return policy


def rebalance(load_LE: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int,
              policy: str = "auto") -> Maps:
    """The placement of E logical experts in `num_physical` slots over `num_gpus` GPUs in `num_nodes` nodes, for
    a per-layer per-expert load [L, E] (tokens routed, or any non-negative estimate of them)."""
    load = check_load(load_LE)
    num_logical = load.shape[1]
    check_sizes(num_logical, num_physical, num_groups, num_nodes, num_gpus)
    if choose_policy(num_groups, num_nodes, policy) == "global":
        num_groups, num_nodes = 1, 1
    return maps_of(_hierarchical(load, num_physical, num_groups, num_nodes, num_gpus), num_logical)


def _hierarchical(load_LE: np.ndarray, num_physical: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> np.ndarray:
    """The three steps; returns the logical expert of each slot [L, P]."""
    layers, num_logical = load_LE.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_physical // num_nodes
    gpus_per_node = num_gpus // num_nodes

    # 1. groups to nodes; "node order" lists each node's experts together: node, then group within it, then expert
    group_node, group_pos = balanced_packing(load_LE.reshape(layers, num_groups, group_size).sum(-1), num_nodes)
    group_start = (group_node * groups_per_node + group_pos) * group_size  # [L, G]
    log_to_ordered = (group_start[:, :, None] + np.arange(group_size)).reshape(layers, num_logical)
    ordered_to_log = np.argsort(log_to_ordered, axis=1)
    ordered_load = np.take_along_axis(load_LE, ordered_to_log, axis=1)

    # 2. each node's slots to its experts (rows: layer x node)
    node_load = ordered_load.reshape(layers * num_nodes, experts_per_node)
    slot_expert, node_counts = replicate(node_load, slots_per_node)

    # 3. each node's replicas to its GPUs, a replica carrying its expert's load over its count
    replica_load = np.take_along_axis(node_load / node_counts, slot_expert, axis=1)
    slot_gpu, slot_pos = balanced_packing(replica_load, gpus_per_node)
    placed = slot_gpu * (num_physical // num_gpus) + slot_pos  # the slot's place among the node's slots
    placed_expert = np.empty_like(slot_expert)
    np.put_along_axis(placed_expert, placed, slot_expert, axis=1)

    node_base = (np.arange(num_nodes) * experts_per_node).repeat(slots_per_node)
    ordered = placed_expert.reshape(layers, num_physical) + node_base
    return np.take_along_axis(ordered_to_log, ordered, axis=1)


def maps_of(phy_to_log_LP: np.ndarray, num_logical: int) -> Maps:
    """The three maps of a placement from its physical-to-logical map [L, P] of expert ids 0 .. E-1: replica r
    of an expert is its r-th slot in slot order. (A count of 0, an expert never placed, is left for the caller to
    refuse.)"""
    layers, num_physical = phy_to_log_LP.shape
    counts = np.zeros((layers, num_logical), np.int64)
    np.add.at(counts, (np.arange(layers)[:, None], phy_to_log_LP), 1)
    order = np.argsort(phy_to_log_LP, axis=1, kind="stable")  # slots grouped by expert, in slot order
    first = np.take_along_axis(np.cumsum(counts, axis=1) - counts, np.take_along_axis(phy_to_log_LP, order, axis=1),
                               axis=1)
    replica = np.empty_like(phy_to_log_LP)
    np.put_along_axis(replica, order, np.arange(num_physical) - first, axis=1)
    log_to_phy = np.full((layers, num_logical, max(int(counts.max()), 1)), -1, np.int64)
    log_to_phy[np.arange(layers)[:, None], phy_to_log_LP, replica] = np.arange(num_physical)
    return Maps(phy_to_log_LP, log_to_phy, counts)


def device_tokens(load_LE: np.ndarray, phy_to_log_LP: np.ndarray, counts_LE: np.ndarray,
                  num_gpus: int) -> np.ndarray:
    """Tokens each GPU's experts receive [L, GPUs] under static dispatch: each slot gets its expert's load
    divided by the expert's replica count."""
    per_replica = np.take_along_axis(load_LE / counts_LE, phy_to_log_LP, axis=1)
    return per_replica.reshape(per_replica.shape[0], num_gpus, -1).sum(-1)


def balancedness(load_LE: np.ndarray, phy_to_log_LP: np.ndarray, counts_LE: np.ndarray,
                 num_gpus: int) -> np.ndarray:
    """Mean / max tokens per GPU, per layer [L]; 1.0 where a layer has no tokens."""
    tokens = device_tokens(np.asarray(load_LE, np.float64), phy_to_log_LP, counts_LE, num_gpus)
    peak = tokens.max(axis=1)
    return np.where(peak > 0, tokens.mean(axis=1) / np.where(peak > 0, peak, 1.0), 1.0)
