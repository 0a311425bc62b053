"""Multi-Head Latent Attention over a paged latent cache.

A token's cache entry is one vector per layer: the normalised kv latent (kv_lora_rank) followed by the
roped shared key (qk_rope_head_dim), `K = kv_lora_rank + rope`. All heads read it.

Three paths:
- `extend` (reading prompts): the latent of the context is expanded into per-head keys and values with
  W_UK / W_UV (kv_b_proj), then ordinary attention;
- `decode`: the absorbed form. q_nope is projected into latent space (q . W_UK), attention runs over the
  latent cache directly, W_UV is applied to the result;
- no cache (`kv_PSK=None`, training): each sequence's context is its own rows of the step, expanded as
  in `extend`; nothing is written.
Inside a shard_map the head axis of the weights is the device's slice of the heads; shapes are read
from the arrays, never from the config.

Shape suffixes: T tokens of the step, B sequences of the step, H heads, N nope dim, R rope dim,
V value dim, L kv_lora_rank, K = L + R, P pages, S page size, C context positions, D hidden.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.fp8 import weight
from jaxdp.model.layers import apply_rope, init_normal, rms_norm

NEG_INF = -1e30  # finite, so rows with an empty context stay NaN-free (their output is discarded)


@dataclasses.dataclass
class AttnBatch:
    """What attention needs of a step (arrays; one pytree node so the step takes few leaves).

    positions_T: position of each token in its sequence; seq_T: which of the B sequences it belongs to
    (B for padding); slots_T: flat cache slot (page * page_size + offset) to write, out of range for
    padding; page_table_BN: pages of each sequence in order; seq_lens_B: context length after the step.
    The last three concern the cache: a step without one (training) leaves them None.
    """

    positions_T: jax.Array
    seq_T: jax.Array
    slots_T: jax.Array | None = None
    page_table_BN: jax.Array | None = None
    seq_lens_B: jax.Array | None = None


jax.tree_util.register_dataclass(
    AttnBatch,
    data_fields=["positions_T", "seq_T", "slots_T", "page_table_BN", "seq_lens_B"],
    meta_fields=[],
)


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        D, H = cfg.hidden_size, cfg.num_heads
        self.cfg = cfg
        if cfg.q_lora_rank is not None:
            self.w_q_a_DQ = nnx.Param(init_normal(rngs, (D, cfg.q_lora_rank), dtype, D))
            self.q_a_norm = nnx.Param(jnp.ones((cfg.q_lora_rank,), dtype))
            self.w_q_b_QHK = nnx.Param(
                init_normal(rngs, (cfg.q_lora_rank, H, cfg.qk_head_dim), dtype, cfg.q_lora_rank)
            )
        else:
            self.w_q_DHK = nnx.Param(init_normal(rngs, (D, H, cfg.qk_head_dim), dtype, D))
        self.w_kv_a_DK = nnx.Param(init_normal(rngs, (D, cfg.kv_cache_dim), dtype, D))
        self.kv_a_norm = nnx.Param(jnp.ones((cfg.kv_lora_rank,), dtype))
        self.w_kv_b_LHX = nnx.Param(
            init_normal(rngs, (cfg.kv_lora_rank, H, cfg.qk_nope_head_dim + cfg.v_head_dim), dtype,
                        cfg.kv_lora_rank)
        )
        self.w_o_HVD = nnx.Param(init_normal(rngs, (H, cfg.v_head_dim, D), dtype, H * cfg.v_head_dim))

    # ---- projections ---------------------------------------------------------------------------
    def queries(self, x_TD: jax.Array, positions_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        if cfg.q_lora_rank is not None:
            q_TQ = rms_norm(x_TD @ weight(self, "w_q_a_DQ"), self.q_a_norm[...], cfg.rms_norm_eps)
            q_THK = jnp.einsum("tq,qhk->thk", q_TQ, weight(self, "w_q_b_QHK"))
        else:
            q_THK = jnp.einsum("td,dhk->thk", x_TD, weight(self, "w_q_DHK"))
        q_nope_THN = q_THK[..., : cfg.qk_nope_head_dim]
        q_rope_THR = apply_rope(q_THK[..., cfg.qk_nope_head_dim :], positions_T, cfg)
        return q_nope_THN, q_rope_THR

    def latent(self, x_TD: jax.Array, positions_T: jax.Array) -> jax.Array:
        """The cache entry of each token: normalised latent, then the roped shared key."""
        cfg = self.cfg
        kv_TK = x_TD @ weight(self, "w_kv_a_DK")
        latent_TL = rms_norm(kv_TK[:, : cfg.kv_lora_rank], self.kv_a_norm[...], cfg.rms_norm_eps)
        k_rope_TR = apply_rope(kv_TK[:, None, cfg.kv_lora_rank :], positions_T, cfg)[:, 0]
        return jnp.concatenate([latent_TL, k_rope_TR], axis=-1)

    def output(self, o_THV: jax.Array) -> jax.Array:
        """o_proj over this device's heads: a partial sum when heads are split over tp."""
        return jnp.einsum("thv,hvd->td", o_THV, weight(self, "w_o_HVD"))

    # ---- the two attention paths -----------------------------------------------------------------
    def __call__(self, x_TD, kv_PSK, batch: AttnBatch, *, absorbed: bool, decode_kernel=None, page_offset=0,
                 pages_per_layer: int | None = None):
        """Write this step's tokens into the cache, attend, project out. Returns (out_TD, kv_PSK).

        kv_PSK may hold the pages of every layer of a stack ([L * P, S, K], as the scan carries it, so
        the step updates the cache in place); this layer's pages start at `page_offset`. With
        kv_PSK None the step's rows are the whole context (training) and None comes back.
        """
        q_nope_THN, q_rope_THR = self.queries(x_TD, batch.positions_T)
        if kv_PSK is None:
            o_THV = self.attend_rows(q_nope_THN, q_rope_THR, self.latent(x_TD, batch.positions_T), batch)
            return self.output(o_THV.astype(x_TD.dtype)), None
        if not isinstance(page_offset, int) or page_offset:  # this layer's pages start at page_offset
            batch = dataclasses.replace(batch, page_table_BN=batch.page_table_BN + page_offset)
        P = pages_per_layer or kv_PSK.shape[0]
        kv_PSK = write_cache(kv_PSK, batch.slots_T, self.latent(x_TD, batch.positions_T), page_offset, P)
        if absorbed:
            o_THV = self.attend_absorbed(q_nope_THN, q_rope_THR, kv_PSK, batch, decode_kernel)
        else:
            o_THV = self.attend_expanded(q_nope_THN, q_rope_THR, kv_PSK, batch)
        return self.output(o_THV.astype(x_TD.dtype)), kv_PSK

    def expand(self, kv_XK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Cache entries [..., K] -> per-head k_nope [..., H, N], values [..., H, V], shared k_rope [..., R]."""
        cfg = self.cfg
        kv_XHX = jnp.einsum("...l,lhx->...hx", kv_XK[..., : cfg.kv_lora_rank], weight(self, "w_kv_b_LHX"))
        return kv_XHX[..., : cfg.qk_nope_head_dim], kv_XHX[..., cfg.qk_nope_head_dim :], kv_XK[..., cfg.kv_lora_rank :]

    def attend_expanded(self, q_nope_THN, q_rope_THR, kv_PSK, batch: AttnBatch) -> jax.Array:
        """Prompt path: expand the context's latent into per-head K and V; causal within each sequence."""
        cfg = self.cfg
        kv_BCK = gather_context(kv_PSK, batch.page_table_BN)
        B, C = kv_BCK.shape[:2]
        k_nope_BCHN, v_BCHV, k_rope_BCR = self.expand(kv_BCK)
        s_THBC = jnp.einsum("thn,bchn->thbc", q_nope_THN, k_nope_BCHN, preferred_element_type=jnp.float32)
        s_THBC += jnp.einsum("thr,bcr->thbc", q_rope_THR, k_rope_BCR, preferred_element_type=jnp.float32)
        own_seq_TB = batch.seq_T[:, None] == jnp.arange(B)[None, :]
        causal_TC = jnp.arange(C)[None, :] <= batch.positions_T[:, None]
        mask_TBC = own_seq_TB[:, :, None] & causal_TC[:, None, :]
        s_THBC = jnp.where(mask_TBC[:, None], s_THBC * cfg.softmax_scale, NEG_INF)
        T, H = s_THBC.shape[:2]
        p_THBC = jax.nn.softmax(s_THBC.reshape(T, H, B * C), axis=-1).reshape(T, H, B, C)
        return jnp.einsum("thbc,bchv->thv", p_THBC.astype(v_BCHV.dtype), v_BCHV)

    def attend_rows(self, q_nope_THN, q_rope_THR, kv_TK, batch: AttnBatch) -> jax.Array:
        """No cache: row t sees the rows u of its own sequence with positions_T[u] <= positions_T[t]."""
        k_nope_THN, v_THV, k_rope_TR = self.expand(kv_TK)
        s_THU = jnp.einsum("thn,uhn->thu", q_nope_THN, k_nope_THN, preferred_element_type=jnp.float32)
        s_THU += jnp.einsum("thr,ur->thu", q_rope_THR, k_rope_TR, preferred_element_type=jnp.float32)
        seq_T, pos_T = batch.seq_T, batch.positions_T
        mask_TU = (seq_T[:, None] == seq_T[None, :]) & (pos_T[None, :] <= pos_T[:, None])
        s_THU = jnp.where(mask_TU[:, None], s_THU * self.cfg.softmax_scale, NEG_INF)
        p_THU = jax.nn.softmax(s_THU, axis=-1)
        return jnp.einsum("thu,uhv->thv", p_THU.astype(v_THV.dtype), v_THV)

    def attend_absorbed(self, q_nope_THN, q_rope_THR, kv_PSK, batch: AttnBatch, decode_kernel=None):
        """Decode path: one token per sequence (T == B); attention over the latent cache itself."""
        cfg = self.cfg
        w_kv_b_LHX = weight(self, "w_kv_b_LHX")
        w_uk_LHN = w_kv_b_LHX[..., : cfg.qk_nope_head_dim]
        w_uv_LHV = w_kv_b_LHX[..., cfg.qk_nope_head_dim :]
        q_latent_BHL = jnp.einsum("bhn,lhn->bhl", q_nope_THN, w_uk_LHN)
        if decode_kernel is not None:
            o_BHL = decode_kernel(q_latent_BHL, q_rope_THR, kv_PSK, batch.page_table_BN, batch.seq_lens_B,
                                  softmax_scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank)
        else:
            o_BHL = mla_decode_xla(q_latent_BHL, q_rope_THR, kv_PSK, batch.page_table_BN, batch.seq_lens_B,
                                   softmax_scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank)
        return jnp.einsum("bhl,lhv->bhv", o_BHL.astype(w_uv_LHV.dtype), w_uv_LHV)


def write_cache(kv_PSK: jax.Array, slots_T: jax.Array, entry_TK: jax.Array, page_offset=0,
                pages_per_layer: int | None = None) -> jax.Array:
    """Scatter the step's entries into their slots; a slot past the layer's pages (padding) is dropped."""
    P, S, K = kv_PSK.shape
    if slots_T.shape[0] == 1:  # XLA:CPU rewrites a one-row scatter into an update that copies the whole
        slots_T = jnp.concatenate([slots_T, jnp.full((1,), P * S, slots_T.dtype)])  # cache; a 2nd (dropped)
        entry_TK = jnp.concatenate([entry_TK, jnp.zeros_like(entry_TK)])  # row keeps it a scatter, in place
    valid = slots_T < (pages_per_layer or P) * S
    idx = jnp.where(valid, slots_T + page_offset * S, P * S)
    flat = kv_PSK.reshape(P * S, K).at[idx].set(entry_TK.astype(kv_PSK.dtype), mode="drop")
    return flat.reshape(P, S, K)


def gather_context(kv_PSK: jax.Array, page_table_BN: jax.Array) -> jax.Array:
    B, N = page_table_BN.shape
    return kv_PSK[page_table_BN].reshape(B, N * kv_PSK.shape[1], kv_PSK.shape[2])


def mla_decode_xla(q_latent_BHL, q_rope_BHR, kv_PSK, page_table_BN, seq_lens_B, *, softmax_scale,
                   kv_lora_rank):
    """The portable absorbed decode (and the reference for the Pallas kernel's use in the model)."""
    kv_BCK = gather_context(kv_PSK, page_table_BN)
    latent_BCL, k_rope_BCR = kv_BCK[..., :kv_lora_rank], kv_BCK[..., kv_lora_rank:]
    s_BHC = jnp.einsum("bhl,bcl->bhc", q_latent_BHL, latent_BCL, preferred_element_type=jnp.float32)
    s_BHC += jnp.einsum("bhr,bcr->bhc", q_rope_BHR, k_rope_BCR, preferred_element_type=jnp.float32)
    valid_BC = jnp.arange(kv_BCK.shape[1])[None, :] < seq_lens_B[:, None]
    s_BHC = jnp.where(valid_BC[:, None, :], s_BHC * softmax_scale, NEG_INF)
    p_BHC = jax.nn.softmax(s_BHC, axis=-1)
    return jnp.einsum("bhc,bcl->bhl", p_BHC.astype(latent_BCL.dtype), latent_BCL)
