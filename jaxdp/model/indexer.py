"""The lightning indexer of DeepSeek sparse attention (GLM-5 `glm_moe_dsa`, DeepSeek-V3.2 `deepseek_v32`).

Per layer, as transformers' `GlmMoeDsaIndexer` / `DeepseekV32Indexer` define it:
- one index key per token: `LayerNorm(x @ wk)` (with bias, eps 1e-6), rope on its first
  `qk_rope_head_dim` values (interleaved pairs for GLM-5, half-split for V3.2), cached in the paged pool
  beside the token's latent;
- per query, `index_n_heads` index queries from the q LoRA residual (`wq_b`), roped the same way;
- the score of an earlier token: sum over index heads of `w_h * relu(q_h . k / sqrt(index_head_dim))`,
  with `w = x @ weights_proj / sqrt(index_n_heads)` (float32);
- the `index_topk` highest-scoring tokens among those the query may see (causal) are kept.

`lax.top_k` returns them in descending score order, so the tokens a query may not see (score -inf) come
last: a selection is `sel_TK` (context positions) plus how many of them are valid,
`min(index_topk, visible)`. A "shared" layer reuses the previous full layer's `sel_TK`. When the step's
context capacity C is at most `index_topk`, every query sees all it may see: no selection is made and
MLA runs dense (the index keys are still written).

Shape suffixes as in `mla.py`; I index heads, E index head dim, C context positions, K selected.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.fp8 import weight
from jaxdp.model.layers import apply_rope, init_normal, param
from jaxdp.ops.gemm import einsum

NEG_INF = -1e30
LAYERNORM_EPS = 1e-6  # transformers' indexer k_norm


class Indexer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        D, Q, I, E = cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
        self.rope_cfg = cfg.with_(rope_interleave=cfg.index_rope_interleave)
        self.w_q_QIE = param(init_normal(rngs, (Q, I, E), dtype, Q), ("q_lora", "index_heads", "index_dim"))
        self.w_k_DE = param(init_normal(rngs, (D, E), dtype, D), ("embed", "index_dim"))
        self.k_norm = param(jnp.ones((E,), dtype), ("index_dim",))
        self.k_norm_bias = param(jnp.zeros((E,), dtype), ("index_dim",))
        self.w_weights_DI = param(init_normal(rngs, (D, I), dtype, D), ("embed", "index_heads"))

    def params_read_in_place(self) -> tuple[str, ...]:
        """The projections, multiplied where they lie in the layer stack (`jaxdp.model.stacked`) by the projection
        GEMM (`jaxdp.ops.gemm`: on a GPU the plain Pallas GEMM, on a CPU as before)."""
        return ("w_q_QIE", "w_k_DE", "w_weights_DI")

    def _rope(self, x_TNE: jax.Array, positions_T: jax.Array) -> jax.Array:
        R = self.rope_cfg.qk_rope_head_dim
        rot = apply_rope(x_TNE[..., :R], positions_T, self.rope_cfg)
        return jnp.concatenate([rot, x_TNE[..., R:]], axis=-1)

    def keys(self, x_TD: jax.Array, positions_T: jax.Array) -> jax.Array:
        """The index key of each token [T, E] (what the pool caches)."""
        k_TE = einsum("td,de->te", x_TD, weight(self, "w_k_DE")).astype(jnp.float32)
        mean = k_TE.mean(-1, keepdims=True)
        var = ((k_TE - mean) ** 2).mean(-1, keepdims=True)
        k_TE = (k_TE - mean) * jax.lax.rsqrt(var + LAYERNORM_EPS)
        k_TE = k_TE * self.k_norm[...].astype(jnp.float32) + self.k_norm_bias[...].astype(jnp.float32)
        return self._rope(k_TE[:, None].astype(x_TD.dtype), positions_T)[:, 0]

    def queries(self, q_resid_TQ: jax.Array, x_TD: jax.Array, positions_T: jax.Array):
        """Index queries [T, I, E] (scaled by 1/sqrt(E)) and head weights [T, I] (float32)."""
        q_TIE = self._rope(einsum("tq,qie->tie", q_resid_TQ, weight(self, "w_q_QIE")), positions_T)
        E, I = q_TIE.shape[-1], q_TIE.shape[-2]
        w_TI = einsum("td,di->ti", x_TD.astype(jnp.float32), weight(self, "w_weights_DI")) * I**-0.5
        return q_TIE.astype(jnp.float32) * E**-0.5, w_TI

    def select(self, q_resid_TQ, x_TD, positions_T, keys_TCE, visible_TC, k: int) -> jax.Array:
        """The `k` context positions each query row keeps, best first [T, k] (see the module doc).
        keys_TCE: each row's own context [T, C, E], or one context all rows share [C, E]."""
        score_TC = self.scores(q_resid_TQ, x_TD, positions_T, keys_TCE)
        return jax.lax.top_k(jnp.where(visible_TC, score_TC, NEG_INF), k)[1].astype(jnp.int32)

    def scores(self, q_resid_TQ, x_TD, positions_T, keys_TCE) -> jax.Array:
        """Each query row's index score of every context position [T, C] (float32; keys as in `select`)."""
        q_TIE, w_TI = self.queries(q_resid_TQ, x_TD, positions_T)
        spec = "tie,ce->tic" if keys_TCE.ndim == 2 else "tie,tce->tic"
        # the keys stay in their dtype (no float32 copy of the context's keys); the dot accumulates in float32
        s_TIC = jnp.einsum(spec, q_TIE.astype(keys_TCE.dtype), keys_TCE, preferred_element_type=jnp.float32)
        return jnp.einsum("tic,ti->tc", jax.nn.relu(s_TIC), w_TI)

    def select_prompt(self, q_resid_TQ, x_TD, positions_T, seq_T, keys_of, C: int, k: int, block: int | None = None):
        """`select` for rows of any sequences (seq_T; B for padding), each over its own sequence's cached
        keys, causally: `keys_of(seq_W)` gives the keys of a block of rows' sequences [rows, C, E] (gathered
        through the page table for that block only). Rows go in blocks (`query_block`) under lax.map, so the
        rows' keys [block, C, E] and scores [block, I, C] exist for one block at a time, prompt or decode."""
        T, (E, I) = x_TD.shape[0], self.w_q_QIE.shape[1:][::-1]
        block = block or query_block(T, C, E, I)

        def rows(args):
            q_TQ, x_TD, pos_T, seq_T = args
            visible_TC = jnp.arange(C)[None, :] <= pos_T[:, None]
            return self.select(q_TQ, x_TD, pos_T, keys_of(seq_T), visible_TC, k)

        args = (q_resid_TQ, x_TD, positions_T, seq_T)
        if block >= T:
            return rows(args)
        pad = -T % block
        blocks = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, block, *a.shape[1:]) for a in args]
        return jax.lax.map(rows, tuple(blocks)).reshape(-1, k)[:T]


QUERY_BLOCK_FLOATS = 1 << 26  # per block of prompt rows: their keys [rows, C, E] and scores [rows, I, C]


def query_block(T: int, C: int, E: int, I: int, budget: int | None = None) -> int:
    """Prompt rows scored at once over a context of C: a power of two (or all T) with
    rows x C x (E + I) <= budget floats (default QUERY_BLOCK_FLOATS, 256 MiB in float32), at least one row."""
    rows = max(1, (budget or QUERY_BLOCK_FLOATS) // (C * (E + I)))
    return T if rows >= T else 1 << (rows.bit_length() - 1)


# ---- fp8 index keys (an option of the pool: SGLang's 132 bytes a token for GLM-5) ----------------------

FP8_BLOCK = 128  # values per fp32 scale
FP8_MAX = 448.0  # largest float8_e4m3fn


def fp8_key_width(dim: int) -> int:
    """Bytes of one packed fp8 index key: `dim` e4m3 values, then one fp32 scale per block of 128."""
    return dim + 4 * -(-dim // FP8_BLOCK)


def pack_fp8_keys(k_TE: jax.Array) -> jax.Array:
    """Index keys [T, E] -> uint8 [T, fp8_key_width(E)]: each block of 128 values scaled to e4m3's range."""
    T, E = k_TE.shape
    block = min(FP8_BLOCK, E)
    if E % block:
        raise ValueError(f"fp8 index keys need index_head_dim {E} to be a multiple of {FP8_BLOCK} (or below it)")
    k_TNB = k_TE.astype(jnp.float32).reshape(T, E // block, block)
    amax_TN = jnp.max(jnp.abs(k_TNB), axis=-1)
    scale_TN = jnp.where(amax_TN > 0, amax_TN / FP8_MAX, 1.0)
    q_TNB = (k_TNB / scale_TN[..., None]).astype(jnp.float8_e4m3fn)
    values = jax.lax.bitcast_convert_type(q_TNB, jnp.uint8).reshape(T, E)
    scales = jax.lax.bitcast_convert_type(scale_TN, jnp.uint8).reshape(T, -1)
    return jnp.concatenate([values, scales], axis=-1)


def unpack_fp8_keys(packed_XW: jax.Array, dim: int) -> jax.Array:
    """uint8 [..., fp8_key_width(dim)] -> float32 keys [..., dim]."""
    lead = packed_XW.shape[:-1]
    block = min(FP8_BLOCK, dim)
    q_XNB = jax.lax.bitcast_convert_type(packed_XW[..., :dim], jnp.float8_e4m3fn).reshape(*lead, dim // block, block)
    scale_XN = jax.lax.bitcast_convert_type(packed_XW[..., dim:].reshape(*lead, dim // block, 4), jnp.float32)
    return (q_XNB.astype(jnp.float32) * scale_XN[..., None]).reshape(*lead, dim)


def selection_size(cfg: ModelConfig, context: int) -> int:
    """Tokens a query keeps in a step whose sequences hold up to `context` positions; 0: no selection
    needed (the model is dense, or every query may keep all it sees)."""
    if not cfg.index_topk or context <= cfg.index_topk:
        return 0
    return cfg.index_topk


def selected_mask(sel_TK: jax.Array, context: int) -> jax.Array:
    """[T, C] bool: position c is among row t's selection (valid or not; callers also mask causally)."""
    T = sel_TK.shape[0]
    return jnp.zeros((T, context), jnp.bool_).at[jnp.arange(T)[:, None], sel_TK].set(True)


# ---- reading a Hugging Face checkpoint -----------------------------------------------------------

# our parameter <- (the tensor under `model.layers.{i}.self_attn.indexer.`, how it is reshaped)
HF_NAMES = {
    "w_q_QIE": ("wq_b.weight", "q_proj"),
    "w_k_DE": ("wk.weight", "transpose"),
    "k_norm": ("k_norm.weight", None),
    "k_norm_bias": ("k_norm.bias", None),
    "w_weights_DI": ("weights_proj.weight", "transpose"),
}


def hf_layout(w: np.ndarray, how: str | None, shape: tuple[int, ...]) -> np.ndarray:
    """A checkpoint's indexer tensor in our layout `shape` (see HF_NAMES)."""
    if how == "q_proj":  # torch [I * E, Q] -> [Q, I, E]
        return w.T.reshape(shape)
    return w.T if how == "transpose" else w


def hf_shape(how: str | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint's shape of an indexer tensor whose shape is `shape` in our layout."""
    if how == "q_proj":
        return (shape[1] * shape[2], shape[0])
    return tuple(reversed(shape)) if how == "transpose" else shape
