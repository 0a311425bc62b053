"""The DeepSeek-V3 MoE: sigmoid router with correction bias and group-limited top-k, routed experts
through a grouped matmul, one shared expert.

Padding rows never reach an expert: `route` gives them the sentinel expert id E (one past the last),
which sorts after every real expert and falls outside every group of the grouped matmul, so the
experts compute exactly the rows a request needs. `routed_experts` returns the rows each expert
received, which the step reports and the tests count.

Under a layout the expert weights a device holds are a slice (TP: a slice of the intermediate dim of
every expert; EP: whole experts `expert_offset .. expert_offset + E_local`); shapes come from the arrays.

NVFP4 experts (`MoE.to_nvfp4`, `--quantization nvfp4`): the routed experts' weights are held in
ModelOpt's layout (see `jaxdp.ops.nvfp4`), in torch's [out, in] orientation, K = the input dim:

| parameter | dtype, shape | |
|---|---|---|
| `w_gate_up_packed` | uint8 [E, 2, I, D/2] | gate (index 0) and up (1), E2M1 two per byte |
| `w_gate_up_scale` | float8_e4m3fn [E, 2, I, D/16] | one scale per 16 values along D |
| `w_gate_up_gscale` | float32 [E] | weight_scale_2, shared by an expert's gate and up |
| `w_down_packed` | uint8 [E, D, I/2] | |
| `w_down_scale` | float8_e4m3fn [E, D, I/16] | one scale per 16 values along I |
| `w_down_gscale` | float32 [E] | |

Gate and up keep their own axis so that TP, which splits I, leaves each device its gate rows and the
matching up rows; the down projection's K is I, so TP needs I / devices to be a multiple of 16
(checked by the step). `runner_backend` (`--moe-runner-backend`, a static field) picks the grouped expert GEMM's
backend; the backends (xla, blocked, pallas, native, auto) and what each reads are `jaxdp.ops.experts`'s. The
model never multiplies an expert no row chose on the default paths.

Redundant experts under EP (`--ep-num-redundant-experts R`, `jaxdp.eplb`): the expert weights hold P = E + R
physical slots (`jaxdp.eplb.slots` builds them from the logical experts), and the layer holds its
logical-to-physical map as data (`ExpertMap` variables, inputs of the compiled step like every weight):
`physical_choices` sends each (row, choice) to one replica of its expert. Static dispatch (SGLang's
`--ep-dispatch-algorithm static`, the default): replica (row + choice) mod the expert's replica count. Dynamic
(`dynamic`, `dynamic_slots`): inside the step, from every device's pairs per expert (all-gathered by the caller,
`jaxdp.parallel.places`), each replicated expert's pairs of this step are split over its replicas so as to keep the
devices' loads even (water-filling, most concentrated expert first), the same split on every device. Without the map
the slots are the logical experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.fp8 import weight
from jaxdp.model.layers import MLP, axes_of, init_normal, param
from jaxdp.ops.experts import dense, routed_expert_blocks, routed_experts, routed_experts_nvfp4
from jaxdp.ops.gemm import router_logits
from jaxdp.ops.nvfp4 import BLOCK_K, quantize_nvfp4_experts, quantize_nvfp4_experts_gate_up

NVFP4_PARAMS = ("w_gate_up_packed", "w_gate_up_scale", "w_gate_up_gscale",
                "w_down_packed", "w_down_scale", "w_down_gscale")
# their logical axes in one layer (a packed or scale dim keeps the name of the dim it packs: D/2 and D/16 are "embed")
NVFP4_AXES = {
    "w_gate_up_packed": ("experts", "gate_up", "expert_mlp", "embed"),
    "w_gate_up_scale": ("experts", "gate_up", "expert_mlp", "embed"),
    "w_gate_up_gscale": ("experts",),
    "w_down_packed": ("experts", "embed", "expert_mlp"),
    "w_down_scale": ("experts", "embed", "expert_mlp"),
    "w_down_gscale": ("experts",),
}


class ExpertMap(nnx.Variable):
    """The EP step's logical-to-physical expert map (`jaxdp.eplb`): data the compiled step reads, not a weight;
    a new map of the same shape is a new input, never a new program."""


class MoE(nnx.Module):
    dispatch_algorithm = "static"  # with an expert map: "static" or "dynamic" (jaxdp.eplb.slots sets it; static)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.quantization: str | None = None  # "nvfp4" once `to_nvfp4` ran
        self.runner_backend = "auto"  # the experts' matmul (--moe-runner-backend, jaxdp.ops; static: in the graph)
        self.router_DE = param(init_normal(rngs, (D, E), jnp.float32, D), ("embed", "expert_scores"))
        self.router_bias_E = param(jnp.zeros((E,), jnp.float32), ("expert_scores",))
        self.w_gate_up_ED2I = param(init_normal(rngs, (E, D, 2, I), dtype, D),
                                    ("experts", "embed", "gate_up", "expert_mlp"))
        self.w_down_EID = param(init_normal(rngs, (E, I, D), dtype, I), ("experts", "expert_mlp", "embed"))
        self.shared = (MLP(D, I * cfg.n_shared_experts, rngs, dtype, mlp_axis="shared_mlp") if cfg.n_shared_experts
                       else None)

    def to_nvfp4(self, params: dict[str, jax.Array] | None = None) -> None:
        """Hold the routed experts as NVFP4 from now on: quantize the dense weights (leading stacked
        dims are kept), or take already quantized `params` (named as in NVFP4_PARAMS)."""
        if self.quantization == "nvfp4":
            return
        if params is None:
            params = nvfp4_expert_params(weight(self, "w_gate_up_ED2I"), weight(self, "w_down_EID"))
        lead = axes_of(self.w_gate_up_ED2I)[:-4]  # a stack's "layers"
        del self.w_gate_up_ED2I, self.w_down_EID
        for name in NVFP4_PARAMS:
            setattr(self, name, param(params[name], (*lead, *NVFP4_AXES[name])))
        self.quantization = "nvfp4"

    def params_read_in_place(self) -> tuple[str, ...]:
        """The parameters the Pallas kernels read from the whole layer stack (`jaxdp.model.stacked`): the NVFP4
        experts and the float32 router under the pallas backend (the experts' Linear weights, block-FP8 or not,
        are handed whole as every Linear weight of the layers is: `jaxdp.model.fp8.in_place`)."""
        if self.runner_backend != "pallas":
            return ()
        return ("router_DE", *NVFP4_PARAMS) if self.quantization == "nvfp4" else ("router_DE",)

    @property
    def num_local_experts(self) -> int:
        """Experts held here (the leading axis of the expert weights inside a layer)."""
        w = self.w_gate_up_packed if self.quantization == "nvfp4" else self.w_gate_up_ED2I
        return w.get_value().shape[0]

    @property
    def has_expert_map(self) -> bool:
        """Whether the experts are held as physical slots with a logical-to-physical map (redundant experts)."""
        return hasattr(self, "expert_slots_ES")

    @property
    def dispatches_dynamically(self) -> bool:
        """Whether `physical_choices` needs every device's pairs per expert (`--ep-dispatch-algorithm dynamic`)."""
        return self.has_expert_map and self.dispatch_algorithm == "dynamic"

    def physical_choices(self, idx_TK: jax.Array, num_physical: int, first_row: jax.Array | int = 0,
                         counts_WE: jax.Array | None = None, device: jax.Array | int = 0) -> jax.Array:
        """The router's logical expert ids [T, K] -> physical slot ids; the padding sentinel E becomes P, one past
        the last slot (num_physical: the slots over all devices). Static dispatch: row t's choice k of expert e goes
        to e's replica (first_row + t + k) mod replicas(e). Dynamic (`dispatches_dynamically`): `dynamic_slots`,
        from `counts_WE` [devices, E] (every device's pairs per logical expert in this step, `count_choices`) and
        this device's index. Without a map the ids are the slots already."""
        if not self.has_expert_map:
            return idx_TK
        slots_ES, replicas_E = self.expert_slots_ES[...], self.expert_replicas_E[...]
        if self.dispatches_dynamically:
            if counts_WE is None:
                raise ValueError("dynamic expert dispatch needs every device's pairs per expert (counts_WE)")
            return dynamic_slots(idx_TK, counts_WE, device, slots_ES, replicas_E, num_physical)
        T, K = idx_TK.shape
        E = slots_ES.shape[0]
        e_TK = jnp.minimum(idx_TK, E - 1)
        turn_TK = first_row + jnp.arange(T, dtype=jnp.int32)[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]
        slot_TK = slots_ES[e_TK, turn_TK % jnp.maximum(replicas_E[e_TK], 1)]
        return jnp.where(idx_TK < E, slot_TK, num_physical).astype(jnp.int32)

    @jax.named_scope("router")
    def route(self, x_TD: jax.Array, valid_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        return route(x_TD, valid_T, self.router_DE.get_value(), self.router_bias_E[...], self.cfg)

    @jax.named_scope("routed_experts")
    def experts(self, x_TD, idx_TK, w_TK, expert_offset=0):
        if self.quantization == "nvfp4":
            q = {name: getattr(self, name).get_value() for name in NVFP4_PARAMS}
            return routed_experts_nvfp4(x_TD, idx_TK, w_TK, q, expert_offset, self.runner_backend)
        gate_up, down = weight(self, "w_gate_up_ED2I"), weight(self, "w_down_EID")
        return routed_experts(x_TD, idx_TK, w_TK, gate_up, down, expert_offset, self.runner_backend)

    @jax.named_scope("routed_experts")
    def expert_blocks(self, x_TD, idx_TK, blocks: int):
        """Each (row, choice) pair's unweighted expert output as `blocks` partial products over the intermediate
        columns held here ([blocks, T, K, D] float32; the fixed reduction tree's, `routed_expert_blocks`), and the
        rows received per held expert. Plain (not NVFP4) experts."""
        return routed_expert_blocks(x_TD, idx_TK, weight(self, "w_gate_up_ED2I"), weight(self, "w_down_EID"), blocks)

    def experts_dense(self, x_TD, idx_TK, w_TK):
        """`experts` computed as every expert on every row, weighted (0 for experts not chosen): the
        same sum, no sorting, and it batches under vmap (training on a CPU, where ragged_dot is a masked
        dense product anyway). Rows received per expert are still counted."""
        if self.quantization is not None:
            raise ValueError("dense experts need the unquantized weights")
        E = self.num_local_experts
        rows_E = jnp.bincount(idx_TK.reshape(-1), length=E + 1)[:E].astype(jnp.int32)
        return dense_experts(x_TD, idx_TK, w_TK, dense(weight(self, "w_gate_up_ED2I")),
                             dense(weight(self, "w_down_EID"))), rows_E

    @jax.named_scope("shared_expert")
    def shared_expert(self, x_TD: jax.Array, blocks: int | None = None) -> jax.Array:
        """[T, D]; with `blocks`, its down projection's partial products [blocks, T, D] float32 (`MLP`)."""
        if self.shared is None:
            return jnp.zeros_like(x_TD) if blocks is None else jnp.zeros((blocks, *x_TD.shape), jnp.float32)
        return self.shared(x_TD, blocks)


def route(x_TD, valid_T, router_DE, bias_E, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Top-k expert ids [T, k] and weights [T, k]; padding rows get id E and weight 0."""
    E, G, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    scores_TE = jax.nn.sigmoid(router_logits(x_TD, router_DE))
    choice_TE = scores_TE + bias_E[None, :]
    if G > 1:
        group_scores_TG = jax.lax.top_k(choice_TE.reshape(-1, G, E // G), 2)[0].sum(-1)
        _, top_groups = jax.lax.top_k(group_scores_TG, cfg.topk_group)
        group_mask_TG = jnp.zeros_like(group_scores_TG, bool).at[
            jnp.arange(x_TD.shape[0])[:, None], top_groups].set(True)
        expert_mask_TE = jnp.repeat(group_mask_TG, E // G, axis=1)
        choice_TE = jnp.where(expert_mask_TE, choice_TE, -jnp.inf)
    _, idx_TK = jax.lax.top_k(choice_TE, k)
    w_TK = jnp.take_along_axis(scores_TE, idx_TK, axis=1)
    if cfg.norm_topk_prob:
        w_TK = w_TK / (w_TK.sum(-1, keepdims=True) + 1e-20)
    w_TK = w_TK * cfg.routed_scaling_factor
    idx_TK = jnp.where(valid_T[:, None], idx_TK, E)
    w_TK = jnp.where(valid_T[:, None], w_TK, 0.0)
    return idx_TK.astype(jnp.int32), w_TK


def count_choices(idx_TK: jax.Array, num_experts: int) -> jax.Array:
    """Tokens routed to each logical expert [E] int32: the (row, choice) pairs of `route`'s ids [T, K], the padding
    rows' sentinel E not counted (what the expert-distribution recorder adds up, `jaxdp.eplb.recorder`)."""
    return jnp.bincount(idx_TK.reshape(-1), length=num_experts + 1)[:num_experts].astype(jnp.int32)


def dynamic_slots(idx_TK, counts_WE, device, slots_ES, replicas_E, num_physical: int) -> jax.Array:
    """Dynamic dispatch: this device's logical ids [T, K] -> physical slots, from every device's pairs per expert
    `counts_WE` [W, E] (the same on every device, so every device computes the same split).

    1. Each expert's pairs over all devices, c_e. Experts with one replica load its device: the base loads.
    2. The replicated experts, most concentrated first (the most pairs per device holding a replica; ties: lower
       id), each split its c_e over the devices holding its replicas by water-filling: the least loaded of them are
       raised to one level (integer amounts, the remainder one each to the devices ending lowest, ties to the lower
       replica); two replicas on one device count once. A second sweep takes each out and fills it again among the
       others' loads, which never raises the most loaded device.
    3. Expert e's pairs are numbered device by device (this device's after the lower devices', in row and choice
       order here), and pair i goes to the replica whose share holds i.
    Fixed shapes, no host round trip: the map's width R + 1 bounds the replicated experts (at most R)."""
    E, S = slots_ES.shape
    W = counts_WE.shape[0]
    per_device = num_physical // W
    counts_WE = counts_WE.astype(jnp.int32)
    c_E = counts_WE.sum(0)
    valid_ES = jnp.arange(S)[None, :] < replicas_E[:, None]
    dev_ES = jnp.where(valid_ES, slots_ES // per_device, -1)
    earlier_SS = jnp.tril(jnp.ones((S, S), bool), -1)  # [j, j']: j' < j
    dup_ES = ((dev_ES[:, :, None] == dev_ES[:, None, :]) & earlier_SS[None] & valid_ES[:, None, :]).any(-1)
    usable_ES = valid_ES & ~dup_ES
    single_E = replicas_E <= 1
    load_W = jnp.zeros((W,), jnp.int32).at[jnp.maximum(dev_ES[:, 0], 0)].add(jnp.where(single_E, c_E, 0))
    share_ES = jnp.zeros((E, S), jnp.int32).at[:, 0].set(c_E)
    if S > 1:  # the most concentrated first: pairs per device that holds a replica
        spread_E = c_E.astype(jnp.float32) / jnp.maximum(usable_ES.sum(1), 1)
        _, order = jax.lax.top_k(jnp.where(single_E, -1.0, spread_E), min(S - 1, E))
        for sweep in range(2):  # (at most R replicated experts, twice: unrolled, no loop on the device)
            for i in range(order.shape[0]):
                e = order[i]
                use_S = usable_ES[e] & ~single_E[e]
                dev_S = jnp.maximum(dev_ES[e], 0)
                if sweep:  # the second sweep takes each expert out and fills it again among the others
                    load_W = load_W.at[dev_S].add(-jnp.where(use_S, share_ES[e], 0))
                a_S = _water_fill(c_E[e], jnp.where(use_S, load_W[dev_S], 0), use_S)
                load_W = load_W.at[dev_S].add(a_S)
                share_ES = share_ES.at[e].set(jnp.where(single_E[e], share_ES[e], a_S))
    T, K = idx_TK.shape
    e_P = idx_TK.reshape(-1)
    live_P = e_P < E
    e_P = jnp.minimum(e_P, E - 1)
    order_P = jnp.argsort(jnp.where(live_P, e_P, E), stable=True)
    sorted_e = jnp.where(live_P, e_P, E)[order_P]
    n_E = jnp.bincount(sorted_e, length=E + 1)
    start_E = jnp.cumsum(n_E) - n_E
    rank_P = jnp.zeros((T * K,), jnp.int32).at[order_P].set(jnp.arange(T * K, dtype=jnp.int32) - start_E[sorted_e])
    before_E = jnp.take(jnp.cumsum(counts_WE, axis=0) - counts_WE, device, axis=0)  # lower devices' pairs
    pair_P = before_E[e_P] + rank_P
    ends_ES = jnp.cumsum(share_ES, axis=1)
    j_P = jnp.minimum((ends_ES[e_P] <= pair_P[:, None]).sum(-1), S - 1)
    slot_P = slots_ES[e_P, j_P]
    return jnp.where(live_P, slot_P, num_physical).astype(jnp.int32).reshape(T, K)


def _water_fill(c, load_S, use_S):
    """Integer amounts [S] summing to c over the entries `use_S`, raising the least loaded to one level."""
    big = jnp.iinfo(jnp.int32).max // 4
    load = jnp.where(use_S, load_S, big).astype(jnp.float32)
    m = use_S.sum()
    srt = jnp.sort(load)
    k = jnp.arange(1, load.shape[0] + 1)
    level_k = (c + jnp.cumsum(jnp.where(k <= m, srt, 0.0))) / k
    fits = (k <= m) & (srt <= level_k)
    level = level_k[jnp.maximum(fits.sum() - 1, 0)]
    f_S = jnp.where(use_S, jnp.floor(jnp.maximum(level - load, 0.0)), 0.0).astype(jnp.int32)
    even_S = jnp.where(use_S, c // jnp.maximum(m, 1), 0)
    f_S = jnp.where(f_S.sum() > c, even_S, f_S)  # (never more than c, whatever the float rounding)
    rest = c - f_S.sum()
    rank_S = jnp.argsort(jnp.argsort(jnp.where(use_S, load_S + f_S, big), stable=True), stable=True)
    return f_S + jnp.where(use_S & (rank_S < rest), 1, 0).astype(jnp.int32)


def dense_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID):
    """sum_e weight(row, e) * expert_e(row) over all E experts, weight 0 where e was not chosen ->
    y_TD float32. idx_TK may hold the padding sentinel E (its one-hot row is all zeros)."""
    E = w_gate_up_ED2I.shape[0]
    w_TE = (jax.nn.one_hot(idx_TK, E, dtype=jnp.float32) * w_TK[..., None]).sum(1)
    h_TE2I = jnp.einsum("td,edxi->texi", x_TD, w_gate_up_ED2I, preferred_element_type=jnp.float32)
    h_TEI = jax.nn.silu(h_TE2I[:, :, 0]) * h_TE2I[:, :, 1] * w_TE[..., None]
    return jnp.einsum("tei,eid->td", h_TEI.astype(x_TD.dtype), w_down_EID, preferred_element_type=jnp.float32)


def nvfp4_expert_params(w_gate_up_ED2I: jax.Array, w_down_EID: jax.Array) -> dict[str, jax.Array]:
    """Dense experts [..., E, D, 2, I] and [..., E, I, D] -> the NVFP4_PARAMS arrays (leading dims kept).

    Quantized as ModelOpt does it: per expert, one weight_scale_2 shared by gate and up, one for down.
    """
    *lead, E, D, _, I = w_gate_up_ED2I.shape
    if D % BLOCK_K or I % BLOCK_K:
        raise ValueError(f"NVFP4 experts need hidden_size ({D}) and moe_intermediate_size ({I}) to be "
                         f"multiples of {BLOCK_K} (the scale block)")
    gu_M2ID = jnp.moveaxis(jnp.asarray(w_gate_up_ED2I), -3, -1).reshape(-1, 2, I, D)
    packed, scale, gscale = quantize_nvfp4_experts_gate_up(gu_M2ID[:, 0], gu_M2ID[:, 1])
    down_MDI = jnp.swapaxes(jnp.asarray(w_down_EID), -1, -2).reshape(-1, D, I)
    d_packed, d_scale, d_gscale = quantize_nvfp4_experts(down_MDI)
    lead_e = (*lead, E)
    return {
        "w_gate_up_packed": packed.reshape(*lead_e, 2, I, D // 2),
        "w_gate_up_scale": scale.reshape(*lead_e, 2, I, D // BLOCK_K),
        "w_gate_up_gscale": gscale.reshape(lead_e),
        "w_down_packed": d_packed.reshape(*lead_e, D, I // 2),
        "w_down_scale": d_scale.reshape(*lead_e, D, I // BLOCK_K),
        "w_down_gscale": d_gscale.reshape(lead_e),
    }
