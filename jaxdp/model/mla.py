"""Multi-Head Latent Attention over a paged latent cache.

A token's cache entry is one vector per layer: the normalised kv latent (kv_lora_rank) followed by the
roped shared key (qk_rope_head_dim), `K = kv_lora_rank + rope`. All heads read it.

Three paths:
- `extend` (reading prompts): the latent of the context is expanded into per-head keys and values with
  W_UK / W_UV (kv_b_proj), then ordinary attention, in blocks of keys and rows (`jaxdp.model.mla_prompt`);
- `decode`: the absorbed form. q_nope is projected into latent space (q . W_UK), attention runs over the
  latent cache directly, W_UV is applied to the result;
- no cache (`kv_PSK=None`, training): each sequence's context is its own rows of the step, expanded as
  in `extend`; nothing is written.
With DeepSeek sparse attention (`cfg.index_topk`, see `jaxdp.model.indexer`) each query reads only the
tokens its layer's indexer selected: both paths gather just the selected latents through the page table
(absorbed) (the sparse decode of `jaxdp.ops.attention`, by `--attention-backend`).
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
from jaxdp.model import mla_prompt
from jaxdp.model.fp8 import weight
from jaxdp.model.indexer import Indexer, pack_fp8_keys, selected_mask, selection_size, unpack_fp8_keys
from jaxdp.model.layers import apply_rope, dot, dot_blocks, init_normal, param, rms_norm
from jaxdp.model.mla_prompt import attend_blocked, attend_dense, attend_selected
from jaxdp.ops.attention import NEG_INF, gather_context, mla_decode_default, sparse_mla_decode_xla, write_rows
from jaxdp.ops.gemm import einsum as weight_einsum
from jaxdp.ops.gemm import projection
from jaxdp.ops.rows import fixed_blocks
from jaxdp.ops.stacked import StackedWeight

ONE_ROW_BLOCK = 16  # a prompt step's one-row sequences (decoders riding along) attended at once


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


@dataclasses.dataclass
class IndexState:
    """What DSA layers carry through a stack: the index-key pages ([L * P, S, E] like kv_PSK, in the cache
    dtype, or uint8 [L * P, S, E + 4 * E / 128] for fp8 keys with their scales; None without a cache) and
    the last full layer's selection sel_TK ([T, index_topk] context positions; None when the step needs
    no selection, see `indexer.selection_size`)."""

    keys_PSE: jax.Array | None
    sel_TK: jax.Array | None


jax.tree_util.register_dataclass(IndexState, data_fields=["keys_PSE", "sel_TK"], meta_fields=[])


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        D, H = cfg.hidden_size, cfg.num_heads
        self.cfg = cfg
        if cfg.q_lora_rank is not None:
            self.w_q_a_DQ = param(init_normal(rngs, (D, cfg.q_lora_rank), dtype, D), ("embed", "q_lora"))
            self.q_a_norm = param(jnp.ones((cfg.q_lora_rank,), dtype), ("q_lora",))
            self.w_q_b_QHK = param(
                init_normal(rngs, (cfg.q_lora_rank, H, cfg.qk_head_dim), dtype, cfg.q_lora_rank),
                ("q_lora", "heads", "head_dim"))
        else:
            self.w_q_DHK = param(init_normal(rngs, (D, H, cfg.qk_head_dim), dtype, D), ("embed", "heads", "head_dim"))
        self.w_kv_a_DK = param(init_normal(rngs, (D, cfg.kv_cache_dim), dtype, D), ("embed", "latent"))
        self.kv_a_norm = param(jnp.ones((cfg.kv_lora_rank,), dtype), ("kv_lora",))
        self.w_kv_b_LHX = param(
            init_normal(rngs, (cfg.kv_lora_rank, H, cfg.qk_nope_head_dim + cfg.v_head_dim), dtype,
                        cfg.kv_lora_rank),
            ("kv_lora", "heads", "head_dim"))
        self.w_o_HVD = param(init_normal(rngs, (H, cfg.v_head_dim, D), dtype, H * cfg.v_head_dim),
                             ("heads", "head_dim", "embed"))
        self.indexer = Indexer(cfg, rngs, dtype) if cfg.index_topk else None

    # ---- projections ---------------------------------------------------------------------------
    @jax.named_scope("mla_projections")
    def queries(self, x_TD: jax.Array, positions_T: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """q_nope [T, H, N], roped q_rope [T, H, R] and the q LoRA residual [T, Q] (None without q LoRA)."""
        cfg = self.cfg
        q_TQ = None
        if cfg.q_lora_rank is not None:
            q_TQ = rms_norm(dot("td,dq->tq", x_TD, weight(self, "w_q_a_DQ")), self.q_a_norm[...], cfg.rms_norm_eps)
            q_THK = dot("tq,qhk->thk", q_TQ, weight(self, "w_q_b_QHK"))
        else:
            q_THK = dot("td,dhk->thk", x_TD, weight(self, "w_q_DHK"))
        q_nope_THN = q_THK[..., : cfg.qk_nope_head_dim]
        q_rope_THR = apply_rope(q_THK[..., cfg.qk_nope_head_dim :], positions_T, cfg)
        return q_nope_THN, q_rope_THR, q_TQ

    @jax.named_scope("mla_projections")
    def latent(self, x_TD: jax.Array, positions_T: jax.Array) -> jax.Array:
        """The cache entry of each token: normalised latent, then the roped shared key."""
        cfg = self.cfg
        kv_TK = dot("td,dk->tk", x_TD, weight(self, "w_kv_a_DK"))
        latent_TL = rms_norm(kv_TK[:, : cfg.kv_lora_rank], self.kv_a_norm[...], cfg.rms_norm_eps)
        k_rope_TR = apply_rope(kv_TK[:, None, cfg.kv_lora_rank :], positions_T, cfg)[:, 0]
        return jnp.concatenate([latent_TL, k_rope_TR], axis=-1)

    @jax.named_scope("mla_projections")
    def output(self, o_THV: jax.Array, blocks: bool = False) -> jax.Array:
        """o_proj over this device's heads: a partial sum when heads are split over tp. With `blocks`
        (--enable-deterministic-inference), its partial products over this device's share of a fixed number of
        blocks of heads, unsummed ([b, T, D] float32, `dot_blocks`): the comm adds every device's blocks by one
        fixed tree (`jaxdp.parallel.places.MeshComm.attn_to_ffn`), so the sum does not depend on tp."""
        if not blocks:
            return dot("thv,hvd->td", o_THV, weight(self, "w_o_HVD"))
        T, H, V = o_THV.shape
        tp = self.cfg.num_heads // H
        blocks = fixed_blocks(self.cfg.num_heads, tp) // tp
        return dot_blocks(o_THV.reshape(T, H * V), weight(self, "w_o_HVD"), 2, blocks)

    # ---- the two attention paths -----------------------------------------------------------------
    def __call__(self, x_TD, kv_PSK, batch: AttnBatch, *, absorbed: bool, decode_kernel=None, page_offset=0,
                 pages_per_layer: int | None = None, index: IndexState | None = None, index_full=True):
        """Write this step's tokens into the cache, attend, project out. Returns (out_TD, kv_PSK, index).

        kv_PSK may hold the pages of every layer of a stack ([L * P, S, K], as the scan carries it, so
        the step updates the cache in place); this layer's pages start at `page_offset`. With
        kv_PSK None the step's rows are the whole context (training) and None comes back.
        index (DSA models): this layer writes its index keys into `index.keys_PSE` (same pages) and, when
        `index_full` (the layer's indexer type: True, or a traced bool in a stack that mixes types), replaces
        `index.sel_TK` by its own
        selection; a "shared" layer attends over the selection it was given.
        """
        q_nope_THN, q_rope_THR, q_TQ = self.queries(x_TD, batch.positions_T)
        if kv_PSK is None:
            sel_TK = None
            if index is not None and index.sel_TK is not None:
                visible_TU = (batch.seq_T[:, None] == batch.seq_T[None, :]) & (
                    batch.positions_T[None, :] <= batch.positions_T[:, None])
                sel_TK = _own_or_given(index_full, lambda: self.indexer.select(
                    q_TQ, x_TD, batch.positions_T, self.indexer.keys(x_TD, batch.positions_T), visible_TU,
                    index.sel_TK.shape[1]), index.sel_TK)
                index = IndexState(None, sel_TK)
            o_THV = self.attend_rows(q_nope_THN, q_rope_THR, self.latent(x_TD, batch.positions_T), batch, sel_TK)
            return self.output(o_THV.astype(x_TD.dtype)), None, index
        if not isinstance(page_offset, int) or page_offset:  # this layer's pages start at page_offset
            batch = dataclasses.replace(batch, page_table_BN=batch.page_table_BN + page_offset)
        P = pages_per_layer or kv_PSK.shape[0]
        kv_TK = self.latent(x_TD, batch.positions_T)
        split = decode_kernel if getattr(decode_kernel, "dcp_size", 1) > 1 else None  # --dcp-size (parallel.dcp)
        slots_T = batch.slots_T if split is None else split.local_slots(batch.slots_T, kv_PSK.shape[1])
        kv_PSK = write_cache(kv_PSK, slots_T, kv_TK, page_offset, P)
        sel_TK = None
        if index is not None:
            keys_TE = self.indexer.keys(x_TD, batch.positions_T)
            if index.keys_PSE.dtype == jnp.uint8:  # the pool holds fp8 index keys
                keys_TE = pack_fp8_keys(keys_TE)
            keys_PSE = write_cache(index.keys_PSE, batch.slots_T, keys_TE, page_offset, P)
            sel_TK = index.sel_TK
            if sel_TK is not None:
                sel_TK = _own_or_given(index_full, lambda: self.select(q_TQ, x_TD, keys_PSE, batch),
                                       index.sel_TK)
            index = IndexState(keys_PSE, sel_TK)
        if split is not None:
            o_THV = self.attend_split(q_nope_THN, q_rope_THR, kv_PSK, batch, split)
        elif absorbed:
            o_THV = self.attend_absorbed(q_nope_THN, q_rope_THR, kv_PSK, batch, decode_kernel, sel_TK)
        else:
            o_THV = self.attend_expanded(q_nope_THN, q_rope_THR, kv_PSK, batch, sel_TK,
                                         kv_TK.astype(kv_PSK.dtype), decode_kernel)
        return self.output(o_THV.astype(x_TD.dtype), getattr(decode_kernel, "batch_invariant", False)), kv_PSK, index

    def select(self, q_TQ, x_TD, keys_PSE, batch: AttnBatch) -> jax.Array:
        """This layer's DSA selection over the cached context of each row's sequence [T, index_topk], prompt
        or decode rows alike: in blocks of rows, each block gathering only its own sequences' index keys."""
        B, N = batch.page_table_BN.shape
        C = N * keys_PSE.shape[1]

        def keys_of(seq_W):
            keys_WCE = gather_context(keys_PSE, batch.page_table_BN[jnp.clip(seq_W, 0, B - 1)])
            if keys_WCE.dtype == jnp.uint8:  # fp8 keys with their scales
                keys_WCE = unpack_fp8_keys(keys_WCE, self.cfg.index_head_dim)
            return keys_WCE

        return self.indexer.select_prompt(q_TQ, x_TD, batch.positions_T, batch.seq_T, keys_of, C,
                                          selection_size(self.cfg, C))

    def expand(self, kv_XK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Cache entries [..., K] -> per-head k_nope [..., H, N], values [..., H, V], shared k_rope [..., R]."""
        cfg = self.cfg
        kv_XL = kv_XK[..., : cfg.kv_lora_rank]
        kv_XHX = weight_einsum("xl,lhy->xhy", kv_XL.reshape(-1, kv_XL.shape[-1]), weight(self, "w_kv_b_LHX"),
                               preferred_element_type=jnp.float32).astype(kv_XK.dtype)
        kv_XHX = kv_XHX.reshape(*kv_XK.shape[:-1], *kv_XHX.shape[1:])
        return kv_XHX[..., : cfg.qk_nope_head_dim], kv_XHX[..., cfg.qk_nope_head_dim :], kv_XK[..., cfg.kv_lora_rank :]

    @jax.named_scope("mla_attention")
    def attend_expanded(self, q_nope_THN, q_rope_THR, kv_PSK, batch: AttnBatch, sel_TK=None,
                        kv_TK=None, decode_kernel=None) -> jax.Array:
        """Prompt path: each row over its own sequence's cached context, causally (expanded per head):
        - a small step in one piece (`mla_prompt.attend_dense`: every sequence's whole page table; it compiles
          faster than loops);
        - a step whose rows fit one [T, H, T] piece: its own rows (kv_TK, the entries it just wrote) in one
          piece and the context cached before it in blocks (`mla_prompt.attend_split`), so a fresh prompt costs
          its own rows, whatever the page table's width and the sequences the step is padded to;
        - any other in blocks (`mla_prompt.attend_blocked`).
        In the last two, the sequences with one row in the step (decoders: a mixed chunk's, or other ranks'
        relabeled as one-token extends beside a prompt) are attended as a decode step attends them, ONE_ROW_BLOCK
        at a time in the absorbed form (`attend_one_rows`), and the loops over sequences skip them: there each
        would run a loop of its own, with its own W_UK / W_UV products.
        With a DSA selection, over the selected latents in the absorbed form (`mla_prompt.attend_selected`).
        Under batch-invariant kernels (`DecodeKernels.batch_invariant`, --enable-deterministic-inference) every row
        is attended as a decode step attends its rows (`attend_each_row`), whatever the step's shape."""
        cfg = self.cfg
        w_kv_b_LHX = weight(self, "w_kv_b_LHX")
        args = (kv_PSK, batch.page_table_BN, batch.seq_T, batch.positions_T)
        if sel_TK is None and getattr(decode_kernel, "batch_invariant", False):
            return self.attend_each_row(q_nope_THN, q_rope_THR, kv_PSK, batch, decode_kernel)
        if sel_TK is None:
            (T, H, N), R = q_nope_THN.shape, q_rope_THR.shape[-1]
            kw = dict(kv_lora_rank=cfg.kv_lora_rank, softmax_scale=cfg.softmax_scale)
            form = mla_prompt.prompt_form(T, H, batch.page_table_BN.size * kv_PSK.shape[1], cfg.kv_lora_rank, N, R,
                                       w_kv_b_LHX.shape[-1] - N, own_rows=kv_TK is not None)
            if form == "dense":
                return attend_dense(q_nope_THN, q_rope_THR, *args, w_kv_b_LHX, **kw)
            one = one_row_sequences(batch)
            if form == "split":
                o_THV = mla_prompt.attend_split(q_nope_THN, q_rope_THR, kv_TK, *args, w_kv_b_LHX, skip_T=one.T, **kw)
            else:
                o_THV = attend_blocked(q_nope_THN, q_rope_THR, *args, w_kv_b_LHX,
                                       see_T=jnp.where(one.T, -1, batch.positions_T), **kw)
            return self.attend_one_rows(q_nope_THN, q_rope_THR, kv_PSK, batch, one, o_THV, decode_kernel)
        q_latent_THL = dot("thn,lhn->thl", q_nope_THN, w_kv_b_LHX[..., : cfg.qk_nope_head_dim])
        o_THL = attend_selected(q_latent_THL, q_rope_THR, *args, sel_TK, kv_lora_rank=cfg.kv_lora_rank,
                                softmax_scale=cfg.softmax_scale)
        return dot("thl,lhv->thv", o_THL.astype(w_kv_b_LHX.dtype), w_kv_b_LHX[..., cfg.qk_nope_head_dim :])

    def attend_one_rows(self, q_nope_THN, q_rope_THR, kv_PSK, batch: AttnBatch, one: OneRows, o_THV,
                        decode_kernel=None):
        """The rows that are their sequence's only row in a prompt step, attended as a decode step attends its
        rows (`attend_absorbed`: each sequence's one query over its latents, which hold the row's own entry
        already), ONE_ROW_BLOCK sequences at a time, as many blocks as there are such sequences: the work
        follows them, not the sequence slots the step is padded to (none for a fresh prompt's step).
        Returns o_THV [T, H, V] (the loops' output, whose one-row rows they skipped) with those rows written in
        place: no buffer of their own beside it."""
        T, B = batch.seq_T.shape[0], batch.page_table_BN.shape[0]
        W = min(ONE_ROW_BLOCK, B)
        order = jnp.argsort(~one.B, stable=True)  # those sequences first
        order = jnp.concatenate([order, jnp.full((-B % W,), B, order.dtype)])  # (whole blocks; B: none)

        def block(i, o_THV):
            b_W = jax.lax.dynamic_slice_in_dim(order, i * W, W)
            real_W = (b_W < B) & one.B[jnp.clip(b_W, 0, B - 1)]
            b_W = jnp.clip(b_W, 0, B - 1)
            rows = dataclasses.replace(batch, page_table_BN=batch.page_table_BN[b_W],
                                       seq_lens_B=jnp.where(real_W, batch.seq_lens_B[b_W], 0))
            t_W = one.row_B[b_W]
            o_WHV = self.attend_absorbed(q_nope_THN[t_W], q_rope_THR[t_W], kv_PSK, rows, decode_kernel)
            return o_THV.at[jnp.where(real_W, t_W, T)].set(o_WHV.astype(o_THV.dtype), mode="drop")

        return jax.lax.fori_loop(0, (jnp.sum(one.B) + W - 1) // W, block, o_THV)

    def attend_each_row(self, q_nope_THN, q_rope_THR, kv_PSK, batch: AttnBatch, decode_kernel) -> jax.Array:
        """Each row of a prompt step over its own sequence's first position + 1 entries (the step's entries are
        written already), in the absorbed form, each row a sequence of its own (`attend_absorbed`): a position's
        attention is then the same arithmetic whether it is read in a prompt (in whatever chunk, after whatever
        prefix-cache hit) or decoded, and does not depend on the step's other rows or its page-table width."""
        B = batch.page_table_BN.shape[0]
        real_T = batch.seq_T < B
        rows = dataclasses.replace(batch, page_table_BN=batch.page_table_BN[jnp.clip(batch.seq_T, 0, B - 1)],
                                   seq_lens_B=jnp.where(real_T, batch.positions_T + 1, 0))
        return self.attend_absorbed(q_nope_THN, q_rope_THR, kv_PSK, rows, decode_kernel)

    @jax.named_scope("mla_attention")
    def attend_split(self, q_nope_THN, q_rope_THR, kv_PSK, batch: AttnBatch, split) -> jax.Array:
        """Over a pool split token-wise over the device's DCP subgroup (`jaxdp.parallel.dcp.SplitContext`): each
        row, a prompt's or a decoder's, over its sequence's first position + 1 tokens in the absorbed form."""
        cfg = self.cfg
        w_kv_b_LHX = weight(self, "w_kv_b_LHX")
        B = batch.page_table_BN.shape[0]
        real_T = batch.seq_T < B
        q_latent_THL = dot("thn,lhn->thl", q_nope_THN, w_kv_b_LHX[..., : cfg.qk_nope_head_dim])
        o_THL = split.attend(q_latent_THL, q_rope_THR, kv_PSK, batch.page_table_BN[jnp.clip(batch.seq_T, 0, B - 1)],
                             jnp.where(real_T, batch.positions_T + 1, 0), softmax_scale=cfg.softmax_scale,
                             kv_lora_rank=cfg.kv_lora_rank)
        w_uv_LHV = w_kv_b_LHX[..., cfg.qk_nope_head_dim :]
        return weight_first("lhv,thl->thv", w_uv_LHV, o_THL.astype(w_uv_LHV.dtype))

    def attend_rows(self, q_nope_THN, q_rope_THR, kv_TK, batch: AttnBatch, sel_TK=None) -> jax.Array:
        """No cache: row t sees the rows u of its own sequence with positions_T[u] <= positions_T[t] (and,
        with a DSA selection, only the selected rows)."""
        k_nope_THN, v_THV, k_rope_TR = self.expand(kv_TK)
        s_THU = jnp.einsum("thn,uhn->thu", q_nope_THN, k_nope_THN, preferred_element_type=jnp.float32)
        s_THU += jnp.einsum("thr,ur->thu", q_rope_THR, k_rope_TR, preferred_element_type=jnp.float32)
        seq_T, pos_T = batch.seq_T, batch.positions_T
        mask_TU = (seq_T[:, None] == seq_T[None, :]) & (pos_T[None, :] <= pos_T[:, None])
        if sel_TK is not None:
            mask_TU &= selected_mask(sel_TK, kv_TK.shape[0])
        s_THU = jnp.where(mask_TU[:, None], s_THU * self.cfg.softmax_scale, NEG_INF)
        p_THU = jax.nn.softmax(s_THU, axis=-1)
        return jnp.einsum("thu,uhv->thv", p_THU.astype(v_THV.dtype), v_THV)

    @jax.named_scope("mla_attention")
    def attend_absorbed(self, q_nope_THN, q_rope_THR, kv_PSK, batch: AttnBatch, decode_kernel=None, sel_TK=None):
        """Decode path: one token per sequence (T == B); attention over the latent cache itself (with a
        DSA selection, over the selected latents only)."""
        cfg = self.cfg
        w_kv_b_LHX = weight(self, "w_kv_b_LHX")
        w_uk_LHN = w_kv_b_LHX[..., : cfg.qk_nope_head_dim]
        w_uv_LHV = w_kv_b_LHX[..., cfg.qk_nope_head_dim :]
        q_latent_BHL = dot("bhn,lhn->bhl", q_nope_THN, w_uk_LHN)
        if sel_TK is not None:
            S = kv_PSK.shape[1]
            page_BK = jnp.take_along_axis(batch.page_table_BN, sel_TK // S, axis=1)
            slots_BK, num_BK = page_BK * S + sel_TK % S, jnp.minimum(batch.seq_lens_B, sel_TK.shape[1])
            # --attention-backend brings its sparse kernel along (jaxdp.ops.attention.DecodeKernels)
            sparse = getattr(decode_kernel, "sparse", None) or sparse_mla_decode_xla
            o_BHL = sparse(q_latent_BHL, q_rope_THR, kv_PSK, slots_BK, num_BK, softmax_scale=cfg.softmax_scale,
                           kv_lora_rank=cfg.kv_lora_rank)
        elif decode_kernel is not None:
            o_BHL = decode_kernel(q_latent_BHL, q_rope_THR, kv_PSK, batch.page_table_BN, batch.seq_lens_B,
                                  softmax_scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank)
        else:
            o_BHL = mla_decode_default(q_latent_BHL, q_rope_THR, kv_PSK, batch.page_table_BN, batch.seq_lens_B,
                                       softmax_scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank)
        return weight_first("lhv,bhl->bhv", w_uv_LHV, o_BHL.astype(w_uv_LHV.dtype))


@dataclasses.dataclass(frozen=True)
class OneRows:
    """A prompt step's sequences with one row in it (decoders riding along): B (which sequences), row_B (that
    row), T (which rows are such a row; padding rows are not)."""
    B: jax.Array
    row_B: jax.Array
    T: jax.Array


def one_row_sequences(batch: AttnBatch) -> OneRows:
    T, B = batch.seq_T.shape[0], batch.page_table_BN.shape[0]
    rows_B = jnp.zeros((B + 1,), jnp.int32).at[batch.seq_T].add(1)[:B]  # (padding rows: sequence B)
    row_B = jnp.zeros((B + 1,), jnp.int32).at[batch.seq_T].max(jnp.arange(T, dtype=jnp.int32))[:B]
    one_B = rows_B == 1
    return OneRows(one_B, row_B, one_B[jnp.clip(batch.seq_T, 0, B - 1)] & (batch.seq_T < B))


def weight_first(eq: str, w: jax.Array, x: jax.Array) -> jax.Array:
    """`layers.dot` with the weight as the einsum's first operand. A per-head product over a weight sliced out
    of kv_b_proj ([L, H, N + V]) makes XLA copy the slice into a head-major layout at every step; with the
    weight first, XLA:CPU copies it keeping its minor axis (a block copy), with x first it transposes the
    latent axis to minor (8 layers of W_UV at batch 1-32: 2.5-4 ms against 14-30 ms, load 8). A weight the
    layer scan handed whole (`StackedWeight`) is multiplied by the projection GEMM (`jaxdp.ops.gemm`: on a GPU
    the per-head Pallas GEMM reading the layer in place), whose xla form is this product."""
    if isinstance(w, StackedWeight):
        ws, xs_out = eq.replace(" ", "").split(",")
        xs, out = xs_out.split("->")
        return projection(f"{xs},{ws}->{out}", x, w, lambda _, x, w: weight_first(eq, w, x))
    pad = x.dtype == jnp.bfloat16 and x.shape[0] == 1  # (as `dot`: a one-row bf16 product is slow)
    xp = jnp.concatenate([x, jnp.zeros_like(x)]) if pad else x
    y = jnp.einsum(eq, w, xp, preferred_element_type=jnp.float32)
    return (y[:1] if pad else y).astype(x.dtype)


def _own_or_given(full, select, given_TK: jax.Array) -> jax.Array:
    """A full layer's own selection, a shared layer's given one (`full` traced: decided in the step)."""
    if full is True:
        return select()
    return jax.lax.cond(full, select, lambda: given_TK)


@jax.named_scope("kv_write")
def write_cache(kv_PSK: jax.Array, slots_T: jax.Array, entry_TK: jax.Array, page_offset=0,
                pages_per_layer: int | None = None) -> jax.Array:
    """Scatter the step's entries into their slots; a slot past the layer's pages (padding) is dropped."""
    P, S, K = kv_PSK.shape
    if slots_T.shape[0] == 1:  # XLA:CPU rewrites a one-row scatter into an update that copies the whole
        slots_T = jnp.concatenate([slots_T, jnp.full((1,), P * S, slots_T.dtype)])  # cache; a 2nd (dropped)
        entry_TK = jnp.concatenate([entry_TK, jnp.zeros_like(entry_TK)])  # row keeps it a scatter, in place
    valid = slots_T < (pages_per_layer or P) * S
    idx = jnp.where(valid, slots_T + page_offset * S, P * S)
    return write_rows(kv_PSK, idx, entry_TK)  # (bf16 on a CPU: in place, natively)
