"""Where each weight lives on the mesh: every parameter declares its logical axes where the model creates it
(`jaxdp.model.layers.param`: one name per dimension, e.g. ("layers", "experts", "embed", "gate_up",
"expert_mlp")), and the rules below map each logical axis to mesh axes under a layout.

Mesh axes: `dp` (attention groups) x `tp` (devices in a group). ALL = both axes, i.e. every device of
the model world.
- attention heads split over `tp`, whole in every group (replicated over `dp`);
- routed experts: TP MoE splits the intermediate dim of every expert over ALL; EP gives each device
  whole experts (the expert axis split over ALL); NVFP4 experts (see `jaxdp.model.moe`) the same, their
  per-expert global scales whole under TP;
- shared expert and dense layers: split over ALL like TP experts when rows are gathered to them,
  whole on every device when they run on a rank's own rows (EP's shared expert, `dense_replicated`);
- LM head: vocab split over ALL, or whole on every device with `dp_lm_head`;
- every other axis (the layer stack, hidden, LoRA ranks, head dims, the embedding's vocab, the router's
  expert scores, the DSA indexer's) whole on every device.
A parameter that declares no axes, or an axis these rules do not name, is an error naming the parameter:
a new weight must say where it lives, never silently replicated.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.layout import Layout
from jaxdp.model.layers import axes_of

ALL = ("dp", "tp")

MeshAxes = str | tuple[str, ...] | None

# Logical axes whole on every device under every layout.
WHOLE = (
    "layers",  # a stack's layer axis
    "embed",  # the hidden size D (NVFP4's packed D/2 and its D/16 scales too)
    "embed_pair",  # the MTP layer's eh_proj input [embedding | hidden], 2 D
    "vocab_in",  # the embedding's rows
    "q_lora", "kv_lora",  # the LoRA ranks of q and kv
    "latent",  # kv_a's output: kv_lora_rank + rope, the cache entry
    "head_dim",  # per head: q/k (nope + rope), v, or kv_b's nope + v
    "expert_scores",  # the router's output, one score per expert
    "expert_replicas",  # an expert's physical slots in the EP expert map (jaxdp.model.moe.ExpertMap)
    "gate_up",  # SwiGLU's gate and up, stored side by side
    "index_heads", "index_dim",  # the DSA indexer's heads and head dim
)
# The axes a layout decides, by what it decides: attention, the MoE layout, dense layers, the LM head.
ATTENTION_RULES = {"heads": "tp"}
MOE_RULES = {
    "tp": {"experts": None, "expert_mlp": ALL, "shared_mlp": ALL},
    "ep": {"experts": ALL, "expert_mlp": None, "shared_mlp": None},
}
DENSE_RULES = {False: {"dense_mlp": ALL}, True: {"dense_mlp": None}}  # by layout.dense_replicated
LM_HEAD_RULES = {"split": {"vocab_out": ALL}, "a2a": {"vocab_out": ALL}, "replicated": {"vocab_out": None}}


def axis_rules(layout: Layout) -> dict[str, MeshAxes]:
    """Logical axis -> the mesh axes it is split over under `layout` (None: whole)."""
    return {**dict.fromkeys(WHOLE), **ATTENTION_RULES, **MOE_RULES[layout.moe],
            **DENSE_RULES[layout.dense_replicated], **LM_HEAD_RULES[lm_head_mode(layout)]}


def logical_spec(axes: tuple[str, ...], layout: Layout, where: str = "") -> P:
    """The PartitionSpec of an array whose dimensions are the logical `axes` (P() when nothing is split)."""
    rules = axis_rules(layout)
    unknown = [a for a in axes if a not in rules]
    if unknown:
        raise ValueError(f"the parameter {where or axes} declares the logical axis {unknown[0]!r}, which no rule "
                         "in jaxdp.parallel.sharding places; name one of its axes or add a rule")
    mesh = [rules[a] for a in axes]
    used = [m for x in mesh if x is not None for m in ((x,) if isinstance(x, str) else x)]
    if len(set(used)) != len(used):
        raise ValueError(f"the parameter {where or axes} would split two of its axes {tuple(axes)} over the same "
                         f"mesh axis under --mesh {layout.spec()}; give one of them another logical axis")
    return P() if not used else P(*mesh)


def param_spec(path: str, param, layout: Layout) -> P:
    """PartitionSpec of the parameter `param` (an nnx.Variable) at `path` (jax keystr of the model state), from
    the logical axes it declared; one that declared none is an error, never silently replicated."""
    axes = axes_of(param) if isinstance(param, nnx.Variable) else None
    if axes is None:
        raise ValueError(f"no sharding rule for the parameter {path}: it declares no logical axes; create it with "
                         "jaxdp.model.layers.param(value, axes) (axis names: jaxdp.parallel.sharding)")
    ndim = len(param.get_value().shape)
    if len(axes) != ndim:
        raise ValueError(f"the parameter {path} declares {len(axes)} logical axes {tuple(axes)} for {ndim} "
                         "dimensions; declare one per dimension")
    return logical_spec(tuple(axes), layout, path)


def lm_head_mode(layout: Layout) -> str:
    """'replicated' (dp_lm_head, or one device), 'a2a' when asked for, else 'split'."""
    if layout.dp_lm_head or layout.world == 1:
        return "replicated"
    return "a2a" if layout.lm_head_a2a else "split"


def state_specs(state, layout: Layout):
    """The model state's tree with each parameter's PartitionSpec in place of its value."""
    return jax.tree_util.tree_map_with_path(lambda p, v: v.replace(param_spec(jax.tree_util.keystr(p), v, layout)),
                                            state, is_leaf=lambda x: isinstance(x, nnx.Variable))


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
