"""The DeepSeek-V3 MoE: sigmoid router with correction bias and group-limited top-k, routed experts
through a grouped matmul, one shared expert.

Padding rows never reach an expert: `route` gives them the sentinel expert id E (one past the last),
which sorts after every real expert and falls outside every group of the grouped matmul, so the
experts compute exactly the rows a request needs. `routed_experts` returns the rows each expert
received, which the step reports and the tests count.

Under a layout the expert weights a device holds are a slice (TP: a slice of the intermediate dim of
every expert; EP: whole experts `expert_offset .. expert_offset + E_local`); shapes come from the arrays.

NVFP4 experts (`MoE.to_nvfp4`, `--quantization nvfp4`): the routed experts' weights are held in
ModelOpt's layout (see `kernels_pallas.nvfp4`), in torch's [out, in] orientation, K = the input dim:

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
(checked by the step). `runner_backend` picks the matmul: "xla" dequantizes and calls
`lax.ragged_dot`; "pallas" runs `kernels_pallas.nvfp4_moe.nvfp4_grouped_matmul` on the sorted rows
(interpret mode on a CPU), and block-FP8 experts `kernels_pallas.fp8_gemm.fp8_grouped_matmul`; both read the
layer where it lies in the layer stack (the scan hands them the whole stack: `jaxdp.model.stacked`).
`jaxdp.model.grouped.grouped_matmul` computes what `lax.ragged_dot` does by blocks of rows, without the
[rows, experts x width] expansion XLA makes of a ragged_dot: bf16 experts use it under "pallas" (they have no
kernel) and "blocked", NVFP4 and FP8 experts under "blocked"; "xla" is `lax.ragged_dot` for every kind.
"auto", the default on a CPU, reads only the experts some row chose: where jaxdp's native kernels are built
(`jaxdp.native`, the CPU's usual case) the rows, sorted by expert, are multiplied by `native.grouped_matmul`,
which reads each chosen expert where it lies in the layer stack and nothing else; without them, with
few (row, choice) pairs (at most a quarter of the experts held here) each pair multiplies its row by its own expert's
weights, gathered (`gathered_experts`: no sort, no loop, and the step reads the chosen experts only; also when
the gathered weights are small, `gathers`); with more, the blocked form. The default on a GPU is pallas.
Nothing on the default paths multiplies an expert no row chose: `lax.ragged_dot` ("xla") is XLA's product per
expert over every row, and on XLA:CPU it also copies every expert's weights each step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.backends import MOE_RUNNER_BACKENDS
from jaxdp.config import ModelConfig
from jaxdp.model.fp8 import StackedWeight, weight
from jaxdp.model.grouped import grouped_matmul
from jaxdp.model.layers import MLP, axes_of, init_normal, param
from jaxdp.model.stacked import InStack
from kernels_pallas.nvfp4 import BLOCK_K, dequantize_nvfp4, quantize_nvfp4_experts, quantize_nvfp4_experts_gate_up

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


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        self.quantization: str | None = None  # "nvfp4" once `to_nvfp4` ran
        self.runner_backend = "auto"  # the experts' matmul, one of MOE_RUNNER_BACKENDS (static: in the graph)
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

    @jax.named_scope("router")
    def route(self, x_TD: jax.Array, valid_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        return route(x_TD, valid_T, self.router_DE.get_value(), self.router_bias_E[...], self.cfg)

    @jax.named_scope("routed_experts")
    def experts(self, x_TD, idx_TK, w_TK, expert_offset=0):
        if self.quantization == "nvfp4":
            q = {name: getattr(self, name).get_value() for name in NVFP4_PARAMS}
            return routed_experts_nvfp4(x_TD, idx_TK, w_TK, q, expert_offset, self.runner_backend)
        gate_up, down = weight(self, "w_gate_up_ED2I"), weight(self, "w_down_EID")
        block_fp8 = all(isinstance(w, StackedWeight) and w.scales is not None for w in (gate_up, down))
        if self.runner_backend == "pallas" and block_fp8:
            operands = gate_up.gemm_operands(1, lead=1), down.gemm_operands(1, lead=1)
            if None not in operands:
                return routed_experts_fp8(x_TD, idx_TK, w_TK, *operands, gate_up.layer, expert_offset)
        return routed_experts(x_TD, idx_TK, w_TK, gate_up, down, expert_offset, self.runner_backend)

    def experts_dense(self, x_TD, idx_TK, w_TK):
        """`experts` computed as every expert on every row, weighted (0 for experts not chosen): the
        same sum, no sorting, and it batches under vmap (training on a CPU, where ragged_dot is a masked
        dense product anyway). Rows received per expert are still counted."""
        if self.quantization is not None:
            raise ValueError("dense experts need the unquantized weights")
        E = self.num_local_experts
        rows_E = jnp.bincount(idx_TK.reshape(-1), length=E + 1)[:E].astype(jnp.int32)
        return dense_experts(x_TD, idx_TK, w_TK, _dense(weight(self, "w_gate_up_ED2I")),
                             _dense(weight(self, "w_down_EID"))), rows_E

    @jax.named_scope("shared_expert")
    def shared_expert(self, x_TD: jax.Array) -> jax.Array:
        return self.shared(x_TD) if self.shared is not None else jnp.zeros_like(x_TD)


def router_logits(x_TD, router_DE) -> jax.Array:
    """x @ router in float32. A router handed whole (`InStack`) is multiplied where the step is lowered for
    a GPU by the Pallas GEMM reading its layer in place (XLA:GPU would copy the layer out of the stack for its
    GEMM), on a CPU as a plain product."""
    from kernels_pallas.fp8_gemm import fp8_matmul, tiles

    x32 = x_TD.astype(jnp.float32)
    if not isinstance(router_DE, InStack) or not tiles(*router_DE.shape):
        return x32 @ router_DE[...].astype(jnp.float32)

    def gemm(x32):
        return fp8_matmul(x32, router_DE.stack, None, None, router_DE.layer, interpret=False)

    return jax.lax.platform_dependent(x32, cpu=lambda x32: x32 @ router_DE[...].astype(jnp.float32), default=gemm)


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


def _grouped(x_TD, idx_TK, w_TK, num_local: int, expert_offset, ffn):
    """Sort the (row, choice) pairs by local expert, run `ffn(x_sorted, group_sizes_E)` -> [T*K, D]
    float32, weight and sum back per row. Pairs whose expert is not held here (another device's, or
    the padding sentinel) sort last, outside every group, and are not computed."""
    T, K = idx_TK.shape
    local_e = idx_TK.reshape(-1) - expert_offset
    held = (local_e >= 0) & (local_e < num_local)
    local_e = jnp.where(held, local_e, num_local)
    order = jnp.argsort(local_e, stable=True)
    tok_sorted = order // K
    group_sizes_E = jnp.bincount(local_e, length=num_local + 1)[:num_local].astype(jnp.int32)
    y = ffn(x_TD[tok_sorted], group_sizes_E)
    y = y * jnp.where(held, w_TK.reshape(-1), 0.0)[order][:, None]
    return jax.ops.segment_sum(y, tok_sorted, num_segments=T), group_sizes_E


def _ragged(backend: str):
    """The grouped matmul of bf16 experts (and of NVFP4 and FP8 ones under "xla" / "blocked"):
    `lax.ragged_dot` under "xla", else the blocked form (under "pallas", the GPU's default, since bf16
    experts have no kernel of their own and XLA's expansion would not fit at full size)."""
    return jax.lax.ragged_dot if backend == "xla" else grouped_matmul


GATHER_BYTES = 8 << 20  # gathered expert weights below this cost less than the blocked loop (compile and run)


def gathers(backend: str, pairs: int, num_local: int, expert_bytes: int = 0) -> bool:
    """Whether `routed_experts` gathers each (row, choice) pair's expert weights: under "auto", when the pairs
    are at most a quarter of the experts held here (the gathered copy, which XLA:CPU writes and reads again, is
    then at most half the layer's experts' bytes), or when what they gather is small (`GATHER_BYTES`: small
    models, whose steps the blocked loop would only slow, and whose compiles it would lengthen)."""
    return backend == "auto" and (4 * pairs <= num_local or pairs * expert_bytes <= GATHER_BYTES)


def routed_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset=0, backend: str = "auto"):
    """Sum over a row's chosen experts (among those held here) of weight * expert(row).

    The weights are arrays or, as the layer scan hands them, `StackedWeight`s (the whole stack and the layer):
    the blocked form then reads each block's expert where it lies in the stack (`grouped_matmul(layer=...)`),
    never copying the layer's experts out first; the gathered form's gather reads the stack in place anyway.
    Returns (y_TD in float32, rows received per local expert [E_local]).
    """
    E_local, D, _, I = w_gate_up_ED2I.shape
    if native_experts(backend, x_TD, (w_gate_up_ED2I, w_down_EID)):
        return jax.lax.platform_dependent(
            x_TD, cpu=lambda x_TD: _native_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset),
            default=lambda x_TD: routed_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset,
                                                "blocked"))
    expert_bytes = 3 * D * I * jnp.dtype(w_gate_up_ED2I.dtype).itemsize
    if gathers(backend, idx_TK.size, E_local, expert_bytes):
        return gathered_experts(x_TD, idx_TK, w_TK, _dense(w_gate_up_ED2I), _dense(w_down_EID), expert_offset)
    stacked = (w_gate_up_ED2I, w_down_EID)
    if backend != "xla" and all(isinstance(w, StackedWeight) and w.scales is None for w in stacked):
        layer = w_gate_up_ED2I.layer
        w1 = w_gate_up_ED2I.values.reshape(-1, E_local, D, 2 * I)
        w2 = w_down_EID.values
        ragged = functools.partial(grouped_matmul, layer=layer)
    else:
        w1, w2 = _dense(w_gate_up_ED2I).reshape(E_local, D, 2 * I), _dense(w_down_EID)
        ragged = _ragged(backend)

    def ffn(x_sorted, sizes_E):
        h = ragged(x_sorted, w1, sizes_E, preferred_element_type=jnp.float32).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return ragged(h, w2, sizes_E, preferred_element_type=jnp.float32)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def native_experts(backend: str, x_TD, stacked) -> bool:
    """Whether a CPU runs the routed experts by `jaxdp.native.grouped_matmul` (under "auto"): plain float32 or
    bf16 experts handed whole by the layer scan (read in place, only the experts some row chose, no copy), their
    widths held here multiples of 16, and the kernels built on this machine."""
    from jaxdp import native

    ok = all(isinstance(w, StackedWeight) and w.scales is None and w.cols is None for w in stacked)
    _, D, _, I = stacked[0].shape  # (held here: I is a slice of it under TP)
    return ok and backend == "auto" and (2 * I) % 16 == 0 and D % 16 == 0 and (
        native.takes(x_TD, *(w.values for w in stacked)))


def _native_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I: StackedWeight, w_down_EID: StackedWeight, expert_offset=0):
    from jaxdp import native

    E_local, D, _, I = w_gate_up_ED2I.shape
    w1 = w_gate_up_ED2I.values.reshape(-1, E_local, D, 2 * I)
    layer = w_gate_up_ED2I.layer

    def ffn(x_sorted, sizes_E):
        h = native.grouped_matmul(x_sorted, w1, layer, sizes_E).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return native.grouped_matmul(h, w_down_EID.values, layer, sizes_E)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def gathered_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset=0):
    """`routed_experts` for few rows: each (row, choice) pair reads its own expert's weights (gathered) and
    multiplies its row by them; pairs whose expert is not held here (another device's, the padding sentinel)
    are computed with expert 0's weights and dropped by a select (never a product: NaN-safe)."""
    T, K = idx_TK.shape
    E_local = w_gate_up_ED2I.shape[0]
    local_TK = idx_TK - expert_offset
    held_TK = (local_TK >= 0) & (local_TK < E_local)
    e_TK = jnp.where(held_TK, local_TK, 0)
    D, I = x_TD.shape[1], w_down_EID.shape[1]
    e_P = e_TK.reshape(-1)
    # each pair's row beside a zero row: a product of two rows is one XLA:CPU runs fast in bf16 (layers.dot)
    x_PMD = jnp.stack([jnp.repeat(x_TD, K, axis=0), jnp.zeros((T * K, D), x_TD.dtype)], axis=1)
    h_PM2I = jnp.einsum("pmd,pdn->pmn", x_PMD, w_gate_up_ED2I[e_P].reshape(T * K, D, 2 * I),
                        preferred_element_type=jnp.float32).reshape(T * K, 2, 2, I)
    h_PMI = (jax.nn.silu(h_PM2I[:, :, 0]) * h_PM2I[:, :, 1]).astype(x_TD.dtype)
    y_PD = jnp.einsum("pmi,pid->pmd", h_PMI, w_down_EID[e_P], preferred_element_type=jnp.float32)[:, 0]
    y_TD = jnp.where(held_TK[..., None], y_PD.reshape(T, K, D) * w_TK[..., None], 0.0).sum(1)
    rows_E = jnp.bincount(jnp.where(held_TK, local_TK, E_local).reshape(-1), length=E_local + 1)[:E_local]
    return y_TD, rows_E.astype(jnp.int32)


def dense_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID):
    """sum_e weight(row, e) * expert_e(row) over all E experts, weight 0 where e was not chosen ->
    y_TD float32. idx_TK may hold the padding sentinel E (its one-hot row is all zeros)."""
    E = w_gate_up_ED2I.shape[0]
    w_TE = (jax.nn.one_hot(idx_TK, E, dtype=jnp.float32) * w_TK[..., None]).sum(1)
    h_TE2I = jnp.einsum("td,edxi->texi", x_TD, w_gate_up_ED2I, preferred_element_type=jnp.float32)
    h_TEI = jax.nn.silu(h_TE2I[:, :, 0]) * h_TE2I[:, :, 1] * w_TE[..., None]
    return jnp.einsum("tei,eid->td", h_TEI.astype(x_TD.dtype), w_down_EID, preferred_element_type=jnp.float32)


def _dense(w):
    """A weight as an array (a StackedWeight: its layer, dequantized; `jaxdp.model.fp8`)."""
    return w.dense() if isinstance(w, StackedWeight) else w


def routed_experts_fp8(x_TD, idx_TK, w_TK, gate_up, down, layer, expert_offset=0):
    """`routed_experts` by the Pallas block-FP8 grouped GEMM (`kernels_pallas.fp8_gemm`; interpret mode on a
    CPU): gate_up and down are `StackedWeight.gemm_operands` ([L, E, K, N] values, [L, E, K/128, S] scales, the
    scale column of each column), the layer read where it lies in its stack."""
    from kernels_pallas.fp8_gemm import fp8_grouped_matmul

    (w1, s1, c1), (w2, s2, c2) = gate_up, down
    E_local, I = w1.shape[1], w1.shape[3] // 2

    def ffn(x_sorted, sizes_E):
        h = fp8_grouped_matmul(x_sorted, w1, s1, c1, sizes_E, layer).astype(jnp.float32).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return fp8_grouped_matmul(h, w2, s2, c2, sizes_E, layer).astype(jnp.float32)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def routed_experts_nvfp4(x_TD, idx_TK, w_TK, q: dict, expert_offset=0, backend: str = "auto"):
    """`routed_experts` with NVFP4 weights (`q`: the NVFP4_PARAMS of one layer, as held here, or each an
    `InStack`: the whole layer stack, which the Pallas kernel reads in place)."""
    if backend not in MOE_RUNNER_BACKENDS:
        raise ValueError(f"MoE runner backend {backend!r} is not one of {', '.join(MOE_RUNNER_BACKENDS)}")
    layer = None
    if backend == "pallas" and all(isinstance(v, InStack) for v in q.values()):
        layer = q["w_gate_up_packed"].layer
        q = {name: v.stack for name, v in q.items()}
    else:
        q = {name: v[...] if isinstance(v, InStack) else v for name, v in q.items()}
    lead = q["w_gate_up_packed"].shape[:-4]  # the layer stack, when read in place
    E_local, _, I, half_D = q["w_gate_up_packed"].shape[-4:]
    gate_up = (q["w_gate_up_packed"].reshape(*lead, E_local, 2 * I, half_D),
               q["w_gate_up_scale"].reshape(*lead, E_local, 2 * I, -1), q["w_gate_up_gscale"])
    down = (q["w_down_packed"], q["w_down_scale"], q["w_down_gscale"])
    matmul = (functools.partial(_nvfp4_matmul_pallas, layer=layer) if backend == "pallas" else
              functools.partial(_nvfp4_matmul_xla, ragged=_ragged(backend)))

    def ffn(x_sorted, sizes_E):
        h = matmul(x_sorted, *gate_up, sizes_E).astype(jnp.float32).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return matmul(h, *down, sizes_E).astype(jnp.float32)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def _nvfp4_matmul_xla(x_TK, packed_ENK2, scale_ENK16, gscale_E, sizes_E, ragged=jax.lax.ragged_dot):
    """Dequantize every held expert to x's dtype, then one grouped matmul (float32 out)."""
    w_ENK = dequantize_nvfp4(packed_ENK2, scale_ENK16, gscale_E, x_TK.dtype)
    return ragged(x_TK, jnp.swapaxes(w_ENK, 1, 2), sizes_E, preferred_element_type=jnp.float32)


def _nvfp4_matmul_pallas(x_TK, packed_ENK2, scale_ENK16, gscale_E, sizes_E, layer=None):
    """The Pallas grouped GEMM (dequantizes in registers; rows outside every group cost nothing); with a
    layer, the weights are the whole stack [L, E, ...] and that layer is read in place."""
    from kernels_pallas.nvfp4_moe import nvfp4_grouped_matmul

    return nvfp4_grouped_matmul(x_TK, packed_ENK2, scale_ENK16, gscale_E, sizes_E, layer)


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
