"""The grouped expert GEMM: the routed experts' SwiGLU over the rows each chose, bf16 / float32, block-FP8 or
NVFP4 experts, with its backends (`jaxdp.ops.registry`: `expert_gemm`, chosen by `--moe-runner-backend`).

Rows are sorted by the (local) expert they chose; pairs whose expert is not held here (another device's, or the
padding sentinel E) sort last, outside every group, and are never computed. The backends:

- xla: `lax.ragged_dot` for every kind of expert (NVFP4 ones dequantized first). XLA expands it into a product per
  expert over every row, and on XLA:CPU it also copies every expert's weights each step;
- blocked: `jaxdp.ops.grouped.grouped_matmul`, the same products by blocks of rows, for every kind of expert
  (plain experts the layer scan handed whole are read where they lie in the stack);
- pallas: the grouped NVFP4 GEMM for NVFP4 experts and the grouped block-FP8 GEMM for FP8 ones (both reading the
  layer in place from the layer stack, with the router: `jaxdp.model.stacked`), the blocked form for bf16 ones
  (they have no kernel); interpret mode on a CPU;
- native (a CPU's): `jaxdp.native.grouped_matmul` reading each chosen expert where it lies in the layer stack, for
  plain float32 / bf16 experts handed whole; the blocked form for others;
- auto (a CPU's default): native where it takes the experts and is built; without it, with few (row, choice)
  pairs (at most a quarter of the experts held here) or small gathered weights, each pair multiplies its row by
  its own expert's weights, gathered (`gathered_experts`: no sort, no loop, only the chosen experts read); with
  more, blocked.
Nothing on the default paths multiplies an expert no row chose.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxdp import native
from jaxdp.ops.grouped import grouped_matmul
from jaxdp.ops.registry import OPS
from jaxdp.ops.stacked import InStack, StackedWeight
from kernels_pallas.fp8_gemm import fp8_grouped_matmul
from kernels_pallas.nvfp4 import dequantize_nvfp4
from kernels_pallas.nvfp4_moe import nvfp4_grouped_matmul

GATHER_BYTES = 8 << 20  # gathered expert weights below this cost less than the blocked loop (compile and run)


def check_backend(backend: str) -> str:
    choices = OPS["expert_gemm"].backends
    if backend not in choices:
        raise ValueError(f"--moe-runner-backend {backend!r} is not one of {', '.join(choices)}")
    return backend


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

    def in_choice_order(y):
        # back to (row, choice) order, then a row's K results added in choice order: XLA:CPU's segment_sum of a
        # row's pairs depended on the number of rows (docs/determinism.md)
        y_TKD = jnp.zeros_like(y).at[order].set(y, unique_indices=True).reshape(T, K, -1)
        out = y_TKD[:, 0]
        for k in range(1, K):
            out = out + y_TKD[:, k]
        return out

    # (on a GPU the scatter-add: the [T * K, D] copy in row order would be a large temp at size, 0.94 GB in
    # float32 for DeepSeek-V3's 4,096 gathered rows x 8 choices, and the determinism it buys is XLA:CPU's)
    out = jax.lax.platform_dependent(y, cpu=in_choice_order,
                                     default=lambda y: jax.ops.segment_sum(y, tok_sorted, num_segments=T))
    return out, group_sizes_E


def _ragged(backend: str):
    """The grouped matmul of bf16 experts (and of NVFP4 and FP8 ones under all but "pallas"): `lax.ragged_dot`
    under "xla", else the blocked form (under "pallas", the GPU's default, since bf16 experts have no kernel of
    their own and XLA's expansion would not fit at full size)."""
    return jax.lax.ragged_dot if backend == "xla" else grouped_matmul


def gathers(backend: str, pairs: int, num_local: int, expert_bytes: int = 0) -> bool:
    """Whether `routed_experts` gathers each (row, choice) pair's expert weights: under "auto", when the pairs
    are at most a quarter of the experts held here (the gathered copy, which XLA:CPU writes and reads again, is
    then at most half the layer's experts' bytes), or when what they gather is small (`GATHER_BYTES`: small
    models, whose steps the blocked loop would only slow, and whose compiles it would lengthen)."""
    return backend == "auto" and (4 * pairs <= num_local or pairs * expert_bytes <= GATHER_BYTES)


def dense(w):
    """A weight as an array (a StackedWeight: its layer, dequantized)."""
    return w.dense() if isinstance(w, StackedWeight) else w


def routed_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset=0, backend: str = "auto"):
    """Sum over a row's chosen experts (among those held here) of weight * expert(row), by `backend`.

    The weights are arrays or, as the layer scan hands them, `StackedWeight`s (the whole stack and the layer):
    the blocked form then reads each block's expert where it lies in the stack (`grouped_matmul(layer=...)`),
    never copying the layer's experts out first; the gathered form's gather reads the stack in place anyway.
    Returns (y_TD in float32, rows received per local expert [E_local]).
    """
    check_backend(backend)
    E_local, D, _, I = w_gate_up_ED2I.shape
    stacked = (w_gate_up_ED2I, w_down_EID)
    if backend == "pallas" and all(isinstance(w, StackedWeight) and w.scales is not None for w in stacked):
        operands = w_gate_up_ED2I.gemm_operands(1, lead=1), w_down_EID.gemm_operands(1, lead=1)
        if None not in operands:
            return routed_experts_fp8(x_TD, idx_TK, w_TK, *operands, w_gate_up_ED2I.layer, expert_offset)
    if backend in ("auto", "native") and native_takes(x_TD, stacked):
        return jax.lax.platform_dependent(
            x_TD, cpu=lambda x_TD: _native_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset),
            default=lambda x_TD: routed_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I, w_down_EID, expert_offset,
                                                "blocked"))
    expert_bytes = 3 * D * I * jnp.dtype(w_gate_up_ED2I.dtype).itemsize
    if gathers(backend, idx_TK.size, E_local, expert_bytes):
        return gathered_experts(x_TD, idx_TK, w_TK, dense(w_gate_up_ED2I), dense(w_down_EID), expert_offset)
    if backend != "xla" and all(isinstance(w, StackedWeight) and w.scales is None for w in stacked):
        layer = w_gate_up_ED2I.layer
        w1 = w_gate_up_ED2I.values.reshape(-1, E_local, D, 2 * I)
        w2 = w_down_EID.values
        ragged = functools.partial(grouped_matmul, layer=layer)
    else:
        w1, w2 = dense(w_gate_up_ED2I).reshape(E_local, D, 2 * I), dense(w_down_EID)
        ragged = _ragged(backend)

    def ffn(x_sorted, sizes_E):
        h = ragged(x_sorted, w1, sizes_E, preferred_element_type=jnp.float32).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return ragged(h, w2, sizes_E, preferred_element_type=jnp.float32)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def native_takes(x_TD, stacked) -> bool:
    """Whether `jaxdp.native.grouped_matmul` can run these routed experts: plain float32 or bf16 experts handed
    whole by the layer scan (read in place, only the experts some row chose, no copy; any widths), and the
    kernels built on this machine."""
    ok = all(isinstance(w, StackedWeight) and w.scales is None and w.cols is None for w in stacked)
    return ok and native.takes(x_TD, *(w.values for w in stacked))


def _native_experts(x_TD, idx_TK, w_TK, w_gate_up_ED2I: StackedWeight, w_down_EID: StackedWeight, expert_offset=0):
    E_local, D, _, I = w_gate_up_ED2I.shape
    w1 = w_gate_up_ED2I.values.reshape(-1, E_local, D, 2 * I)
    layer = w_gate_up_ED2I.layer

    def ffn(x_sorted, sizes_E):
        h = native.grouped_matmul(x_sorted, w1, layer, sizes_E).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return native.grouped_matmul(h, w_down_EID.values, layer, sizes_E)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def routed_expert_blocks(x_TD, idx_TK, w_gate_up_ED2I, w_down_EID, blocks: int, expert_offset=0):
    """Each (row, choice) pair's expert output, unweighted, as the partial products of its down projection over
    `blocks` blocks of the intermediate columns held here: float32 [blocks, T, K, D], zeros for pairs whose expert
    is not held here (the fixed reduction tree of --enable-deterministic-inference: `jaxdp.ops.rows.block_sum`
    adds the blocks of every device in one order, `jaxdp.parallel.places`). Native on a CPU (each block's partial
    has the bits of the product of that block alone, whichever device holds it), the gathered form elsewhere.
    Returns (the partials, rows received per local expert [E_local])."""
    T, K = idx_TK.shape
    E_local, D, _, I = w_gate_up_ED2I.shape
    local_e = idx_TK.reshape(-1) - expert_offset
    held = (local_e >= 0) & (local_e < E_local)
    local_e = jnp.where(held, local_e, E_local)
    order = jnp.argsort(local_e, stable=True)
    sizes_E = jnp.bincount(local_e, length=E_local + 1)[:E_local].astype(jnp.int32)
    stacked = (w_gate_up_ED2I, w_down_EID)

    def unsorted(y_bPD):  # back to (row, choice) order
        return jnp.zeros_like(y_bPD).at[:, order].set(y_bPD, unique_indices=True).reshape(blocks, T, K, D)

    def gathered(x_TD):
        e_P = jnp.where(held, local_e, 0)
        h_P2I = jnp.einsum("pd,pdxi->pxi", jnp.repeat(x_TD, K, axis=0), dense(w_gate_up_ED2I)[e_P],
                           preferred_element_type=jnp.float32)
        h_PI = (jax.nn.silu(h_P2I[:, 0]) * h_P2I[:, 1]).astype(x_TD.dtype)
        y_bPD = jnp.einsum("pbi,pbid->bpd", h_PI.reshape(T * K, blocks, I // blocks),
                           dense(w_down_EID)[e_P].reshape(T * K, blocks, I // blocks, D),
                           preferred_element_type=jnp.float32)
        return jnp.where(held[None, :, None], y_bPD, 0.0).reshape(blocks, T, K, D)

    if not native_takes(x_TD, stacked):
        return gathered(x_TD), sizes_E

    def cpu(x_TD):
        w1 = w_gate_up_ED2I.values.reshape(-1, E_local, D, 2 * I)
        h = native.grouped_matmul(x_TD[order // K], w1, w_gate_up_ED2I.layer, sizes_E).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        y = native.grouped_matmul(h, w_down_EID.values, w_down_EID.layer, sizes_E, kblocks=blocks)
        return unsorted(y.reshape(blocks, T * K, D))

    return jax.lax.platform_dependent(x_TD, cpu=cpu, default=gathered), sizes_E


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


def routed_experts_fp8(x_TD, idx_TK, w_TK, gate_up, down, layer, expert_offset=0):
    """`routed_experts` by the Pallas block-FP8 grouped GEMM (`kernels_pallas.fp8_gemm`; interpret mode on a
    CPU): gate_up and down are `StackedWeight.gemm_operands` ([L, E, K, N] values, [L, E, K/128, S] scales, the
    scale column of each column), the layer read where it lies in its stack."""
    (w1, s1, c1), (w2, s2, c2) = gate_up, down
    E_local, I = w1.shape[1], w1.shape[3] // 2

    def ffn(x_sorted, sizes_E):
        h = fp8_grouped_matmul(x_sorted, w1, s1, c1, sizes_E, layer).astype(jnp.float32).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return fp8_grouped_matmul(h, w2, s2, c2, sizes_E, layer).astype(jnp.float32)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def routed_experts_nvfp4(x_TD, idx_TK, w_TK, q: dict, expert_offset=0, backend: str = "auto"):
    """`routed_experts` with NVFP4 weights (`q`: the model's NVFP4 parameters of one layer, as held here, or each
    an `InStack`: the whole layer stack, which the Pallas kernel reads in place): the Pallas NVFP4 GEMM under
    "pallas", `lax.ragged_dot` of the dequantized experts under "xla", the blocked form of them otherwise."""
    check_backend(backend)
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
    matmul = (functools.partial(nvfp4_matmul_pallas, layer=layer) if backend == "pallas" else
              functools.partial(nvfp4_matmul_xla, ragged=_ragged(backend)))

    def ffn(x_sorted, sizes_E):
        h = matmul(x_sorted, *gate_up, sizes_E).astype(jnp.float32).reshape(-1, 2, I)
        h = (jax.nn.silu(h[:, 0]) * h[:, 1]).astype(x_TD.dtype)
        return matmul(h, *down, sizes_E).astype(jnp.float32)

    return _grouped(x_TD, idx_TK, w_TK, E_local, expert_offset, ffn)


def nvfp4_matmul_xla(x_TK, packed_ENK2, scale_ENK16, gscale_E, sizes_E, ragged=jax.lax.ragged_dot):
    """Dequantize every held expert to x's dtype, then one grouped matmul (float32 out)."""
    w_ENK = dequantize_nvfp4(packed_ENK2, scale_ENK16, gscale_E, x_TK.dtype)
    return ragged(x_TK, jnp.swapaxes(w_ENK, 1, 2), sizes_E, preferred_element_type=jnp.float32)


def nvfp4_matmul_pallas(x_TK, packed_ENK2, scale_ENK16, gscale_E, sizes_E, layer=None):
    """The Pallas grouped GEMM (dequantizes in registers; rows outside every group cost nothing); with a
    layer, the weights are the whole stack [L, E, ...] and that layer is read in place."""
    return nvfp4_grouped_matmul(x_TK, packed_ENK2, scale_ENK16, gscale_E, sizes_E, layer)
