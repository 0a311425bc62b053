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


# Whole on every device: embedding, norms, router, the attention's down-projections (q_a, kv_a: their outputs
# are LoRA latents every head needs), the DSA indexer's weights, the MTP layer's norms and eh_proj.
REPLICATED = frozenset({
    "embed_VD", "attn_norm", "ffn_norm", "final_norm", "weight", "q_a_norm", "kv_a_norm", "k_norm", "k_norm_bias",
    "router_DE", "router_bias_E", "w_q_a_DQ", "w_kv_a_DK", "w_q_QIE", "w_k_DE", "w_weights_DI",
    "enorm", "hnorm", "w_eh_XD", "shared_head_norm",  # the MTP layer's own (jaxdp.model.mtp; eh_proj as SGLang)
})


def param_spec(path: str, ndim: int, layout: Layout) -> P:
    """PartitionSpec of the parameter at `path` (jax keystr of the model state); a name this module does not
    know is an error (a new weight must say where it lives), never silently replicated."""
    name = path.split("['")[-1].split("']")[0].removesuffix("_bscale")  # FP8 block scales: as their weight
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
    if name in REPLICATED:
        return P()
    raise ValueError(f"no sharding rule for the parameter {path}; add its name to jaxdp.parallel.sharding")


def lm_head_mode(layout: Layout) -> str:
    """'replicated' (dp_lm_head, or one device), 'a2a' when asked for, else 'split'."""
    if layout.dp_lm_head or layout.world == 1:
        return "replicated"
    return "a2a" if layout.lm_head_a2a else "split"


def state_specs(state, layout: Layout):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: param_spec(jax.tree_util.keystr(p), x.ndim, layout), state)


def shard_state(state, layout: Layout, mesh):
    specs = state_specs(state, layout)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)


def check_divisible(cfg, layout: Layout, expert_quantization: str | None = None) -> None:
    """Refuse, in one sentence, a layout whose splits do not divide the model's sizes (before any weight
    is allocated)."""
    lay = layout
    problems = []
    if cfg.num_heads % lay.tp:
        problems.append(f"{cfg.num_heads} attention heads over tp={lay.tp}")
    if lay.moe == "ep" and cfg.n_routed_experts % lay.world:
        problems.append(f"{cfg.n_routed_experts} experts over {lay.world} devices (EP)")
    if lay.moe == "tp" and cfg.moe_intermediate_size % lay.world:
        problems.append(f"moe_intermediate_size {cfg.moe_intermediate_size} over {lay.world} devices")
    elif lay.moe == "tp" and expert_quantization == "nvfp4" and (cfg.moe_intermediate_size // lay.world) % 16:
        problems.append(f"NVFP4 experts' moe_intermediate_size {cfg.moe_intermediate_size} over {lay.world} "
                        f"devices ({cfg.moe_intermediate_size // lay.world} each, not a multiple of the "
                        "16-value scale block; moe=ep splits whole experts instead)")
    if lm_head_mode(lay) != "replicated" and cfg.vocab_size % lay.world:
        problems.append(f"vocab {cfg.vocab_size} over {lay.world} devices (use --enable-dp-lm-head)")
    if problems:
        raise ValueError(f"this model does not split under --mesh {lay.spec()}: " + "; ".join(problems)
                         + "; choose a layout whose sizes divide these")
