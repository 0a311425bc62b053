"""Where each weight lives on the mesh: one table of rules, keyed by the parameter's name.

Mesh axes: `dp` (attention groups) x `tp` (devices in a group). ALL = both axes, i.e. every device of
the model world.
- attention projections: heads split over `tp`, whole in every group (replicated over `dp`);
- routed experts: TP MoE splits the intermediate dim of every expert over ALL; EP gives each device
  whole experts (the expert axis split over ALL); NVFP4 experts (see `jaxdp.model.moe`) the same, their
  per-expert global scales whole under TP;
- shared expert and dense layers: split over ALL like TP experts when rows are gathered to them,
  whole on every device when they run on a rank's own rows (EP's shared expert, `dense_replicated`);
- LM head: vocab split over ALL, or whole on every device with `dp_lm_head`;
- embedding, norms, router: whole on every device.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.layout import Layout

ALL = ("dp", "tp")
# Routed experts, stacked [L, E, ...]: the axis of the intermediate dim I that TP MoE splits (None: whole
# under TP). EP splits the expert axis (1) of all of them.
EXPERT_I_AXIS = {
    "w_gate_up_ED2I": 4, "w_down_EID": 2,  # dense [L, E, D, 2, I], [L, E, I, D]
    "w_gate_up_packed": 3, "w_gate_up_scale": 3, "w_gate_up_gscale": None,  # [L, E, 2, I, D/2 | D/16], [L, E]
    "w_down_packed": 3, "w_down_scale": 3, "w_down_gscale": None,  # [L, E, D, I/2 | I/16], [L, E]
}


def param_spec(path: str, ndim: int, layout: Layout) -> P:
    """PartitionSpec of the parameter at `path` (jax keystr of the model state)."""
    name = path.split("['")[-1].split("']")[0]
    in_dense = "dense_layers" in path
    in_shared = "['shared']" in path
    heads_on_tp = {
        "w_q_b_QHK": P(None, None, "tp", None),
        "w_q_DHK": P(None, None, "tp", None),
        "w_kv_b_LHX": P(None, None, "tp", None),
        "w_o_HVD": P(None, "tp", None, None),
    }
    if name in heads_on_tp:
        return heads_on_tp[name]
    if name in EXPERT_I_AXIS:
        split = 1 if layout.moe == "ep" else EXPERT_I_AXIS[name]
        return P(*(ALL if axis == split else None for axis in range(ndim)))
    if name in ("w_gate_up_D2F", "w_down_FD"):
        replicated = (in_dense and layout.dense_replicated) or (in_shared and layout.moe == "ep")
        if replicated:
            return P()
        return P(None, None, None, ALL) if name == "w_gate_up_D2F" else P(None, ALL, None)
    if name == "lm_head_DV":
        return P() if lm_head_mode(layout) == "replicated" else P(None, ALL)
    return P()


def lm_head_mode(layout: Layout) -> str:
    """'replicated' (dp_lm_head, or one device), 'a2a' when asked for, else 'split'."""
    if layout.dp_lm_head or layout.world == 1:
        return "replicated"
    return "a2a" if getattr(layout, "lm_head_a2a", False) else "split"


def state_specs(state, layout: Layout):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: param_spec(jax.tree_util.keystr(p), x.ndim, layout), state)


def shard_state(state, layout: Layout, mesh):
    specs = state_specs(state, layout)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)
