"""MLA's prompt path over the paged cache, in blocks: memory bounded by the blocks, not by rows x context.

The prompt rows of a step (T rows of up to B sequences; decoders riding along are one-row sequences) attend to
their own sequence's cached context, causally. Written densely that is a [T, H, B, C] score array and every
sequence's whole context expanded into per-head keys and values: at DeepSeek-V3's widths an 8k-token chunk
against 8 sequences of 4k is 128 GiB of scores. Here, instead (flash attention's online softmax, as SGLang's
chunked-prefix MLA does it):

- for each sequence b of the step, for each key block j of `key_block` positions up to the highest position
  of b's rows: the block's latents are gathered through b's page table and expanded once ([Kb, H, N + V]);
- then each window of `row_block` rows of b that can see the block (rows of a sequence are contiguous in
  the step; a window starts at b's first row that reaches the block) scores it ([Tb, H, Kb]) and folds
  it into running maxima, sums and outputs kept for all rows ([T, H] and [T, H, V], float32).

The loops have data-dependent trip counts (`lax.fori_loop` over traced bounds), so a short context costs
short work in a step compiled for a wide page table, and a decoder's one row costs one window per block.
Work: each key is expanded once per step; each (row, key) pair is scored once, plus the ragged edges.

With a DSA selection each row reads only its `index_topk` selected latents, in the absorbed form (as
decode does; flat in the context): `attend_selected`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdp.ops.attention import NEG_INF, attend_latents
from jaxdp.ops.gemm import einsum as weight_einsum  # (w_kv_b may be a layer of its stack, read in place)

__all__ = ["NEG_INF", "attend_blocked", "attend_dense", "attend_latents", "attend_selected", "attend_split",
           "prompt_form"]  # (NEG_INF and attend_latents: the decode's, `jaxdp.ops.attention`)

ROW_BLOCK = 256  # rows scored against a key block at once
KEY_BLOCK = 512  # context positions expanded at once (rounded to whole pages)
ABSORBED_BLOCK = 16  # rows of a sequence with few rows, attended in the absorbed form at once
DENSE_MAX_SCORES = 1 << 24  # a step whose dense scores [T, H, B, C] are this small runs `attend_dense` ...
DENSE_MAX_MACS = 1 << 25  # ... if its work is this small too: it grows with every sequence slot's whole context
SELECTED_FLOATS = 1 << 25  # sparse rows: gathered latents [rows, index_topk, K] per block of rows


def fold(state, s_WHX, mask_WX, values_XHY, spec: str):
    """Online softmax: fold one block's scores (already scaled; `mask_WX` the pairs that count) into the
    running (max, sum, output) of its rows."""
    m_old, l_old, o_old = state
    s_WHX = jnp.where(mask_WX[:, None], s_WHX, NEG_INF)
    m_new = jnp.maximum(m_old, s_WHX.max(-1))
    p_WHX = jnp.where(mask_WX[:, None], jnp.exp(s_WHX - m_new[..., None]), 0.0)
    scale_WH = jnp.exp(m_old - m_new)
    o_new = o_old * scale_WH[..., None] + jnp.einsum(spec, p_WHX.astype(values_XHY.dtype), values_XHY,
                                                     preferred_element_type=jnp.float32)
    return m_new, l_old * scale_WH + p_WHX.sum(-1), o_new


def put(state, at, mine_W, new):
    """Write a window's new (max, sum, output) into the step's at row `at`, for its own rows only."""
    out = []
    for a, n in zip(state, new, strict=True):
        old = jax.lax.dynamic_slice_in_dim(a, at, mine_W.shape[0])
        out.append(jax.lax.dynamic_update_slice_in_dim(a, jnp.where(mine_W.reshape(-1, *[1] * (n.ndim - 1)), n,
                                                                    old), at, 0))
    return tuple(out)


def attend_blocked(q_nope_THN, q_rope_THR, kv_PSK, page_table_BN, seq_T, pos_T, w_kv_b_LHX, *, kv_lora_rank: int,
                   softmax_scale: float, row_block: int = ROW_BLOCK, key_block: int = KEY_BLOCK,
                   absorbed_block: int = ABSORBED_BLOCK, see_T=None) -> jax.Array:
    """Causal attention of each row over its sequence's cache (seq_T: B for padding rows) -> [T, H, V]
    (see_T: as `blocked_state`'s)."""
    state = blocked_state(q_nope_THN, q_rope_THR, kv_PSK, page_table_BN, seq_T, pos_T, w_kv_b_LHX,
                          kv_lora_rank=kv_lora_rank, softmax_scale=softmax_scale, row_block=row_block,
                          key_block=key_block, absorbed_block=absorbed_block, see_T=see_T)
    return finish(state).astype(w_kv_b_LHX.dtype)


def finish(state) -> jax.Array:
    """The output of an online softmax's (max, sum, output) state; rows that saw nothing get zeros."""
    _, l_TH, o_THV = state
    return o_THV / jnp.where(l_TH > 0, l_TH, 1.0)[..., None]


def blocked_state(q_nope_THN, q_rope_THR, kv_PSK, page_table_BN, seq_T, pos_T, w_kv_b_LHX, *, kv_lora_rank: int,
                  softmax_scale: float, row_block: int = ROW_BLOCK, key_block: int = KEY_BLOCK,
                  absorbed_block: int = ABSORBED_BLOCK, see_T=None):
    """`attend_blocked`'s (max, sum, output) state, float32, unnormalised. see_T: the highest cache position
    each row reads (default pos_T: causal over its whole context; -1: none)."""
    T, H, N = q_nope_THN.shape
    V = w_kv_b_LHX.shape[-1] - N
    S, K = kv_PSK.shape[1:]
    L, R = kv_lora_rank, K - kv_lora_rank
    B, NP = page_table_BN.shape
    pages = max(1, min(key_block // S, NP))
    if NP % pages:  # whole key blocks; the extra pages sit past every position (masked)
        page_table_BN = jnp.pad(page_table_BN, ((0, 0), (0, pages - NP % pages)))
    Kb, Tb, Ta = pages * S, min(row_block, T), min(absorbed_block, T)  # key block, windows' rows
    # a sequence with few rows here (a decoder riding along, a short prompt's tail) is cheaper in the absorbed
    # form: per key, n rows x (2L + R) against expanding the key, L (N + V), plus a window's scores, Tb (N + R + V)
    absorb_below = (L * (N + V) + Tb * (N + R + V)) // (2 * L + R)
    rows_T = jnp.arange(T)
    see_T = pos_T if see_T is None else see_T
    w_uk_LHN, w_uv_LHV = w_kv_b_LHX[..., :N], w_kv_b_LHX[..., N:]

    def keys(b, j):
        table = jax.lax.dynamic_slice_in_dim(page_table_BN[b], j * pages, pages)
        return kv_PSK[table].reshape(Kb, K), j * Kb + jnp.arange(Kb)

    def window_of(mask_T, start, size):
        """Rows [start, start + size) that are in mask_T, as a slice start that stays inside the step."""
        at = jnp.minimum(start, T - size)  # a window that would run off the end moves back, its extra rows masked
        idx = at + jnp.arange(size)
        return at, mask_T[idx] & (idx >= start)

    def span(mask_T):
        return jnp.min(jnp.where(mask_T, rows_T, T)), jnp.max(jnp.where(mask_T, rows_T, -1))

    def expanded(b, carry, on):
        """Each key block of b expanded once, scored by every window of b's rows that sees it."""
        def key_block_of(j, carry):
            kv_XK, key_pos_X = keys(b, j)
            kv_XHY = weight_einsum("xl,lhy->xhy", kv_XK[:, :L], w_kv_b_LHX)
            k_nope_XHN, v_XHV = kv_XHY[..., :N], kv_XHY[..., N:]
            sees_T = (seq_T == b) & (see_T >= j * Kb)  # b's rows that see part of this block
            first, last = span(sees_T)

            def window(r, carry):
                at, mine_W = window_of(sees_T, first + r * Tb, Tb)
                sl = lambda a: jax.lax.dynamic_slice_in_dim(a, at, Tb)  # noqa: E731
                s_WHX = jnp.einsum("whn,xhn->whx", sl(q_nope_THN), k_nope_XHN, preferred_element_type=jnp.float32)
                s_WHX += jnp.einsum("whr,xr->whx", sl(q_rope_THR), kv_XK[:, L:], preferred_element_type=jnp.float32)
                mask_WX = mine_W[:, None] & (key_pos_X[None, :] <= sl(see_T)[:, None])
                old = tuple(sl(a) for a in carry)
                new = fold(old, s_WHX * softmax_scale, mask_WX, v_XHV, "whx,xhv->whv")
                return put(carry, at, mine_W, new)

            windows = jnp.where(last >= first, (last - first) // Tb + 1, 0)
            return jax.lax.fori_loop(0, windows, window, carry)

        top = jnp.max(jnp.where(seq_T == b, see_T, -1))  # the highest position b's rows read
        return jax.lax.fori_loop(0, jnp.where(on, (top + Kb) // Kb, 0), key_block_of, carry)

    def absorbed(b, carry, Ta, on):
        """Each window of Ta of b's rows over b's latents (q . W_UK, scores over the latents, W_UV after):
        nothing expanded. Writes the rows' (max, sum, output) (the output W_UV of the latents' sum)."""
        mine_T = (seq_T == b) & (see_T >= 0)  # (rows that read no cached position have nothing to do)
        first, last = span(mine_T)

        def window(r, carry):
            at, mine_W = window_of(mine_T, first + r * Ta, Ta)
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, at, Ta)  # noqa: E731
            q_latent_WHL = weight_einsum("whn,lhn->whl", sl(q_nope_THN), w_uk_LHN)
            q_rope_WHR, see_W = sl(q_rope_THR), sl(see_T)

            def key_block_of(j, state):
                kv_XK, key_pos_X = keys(b, j)
                s_WHX = jnp.einsum("whl,xl->whx", q_latent_WHL, kv_XK[:, :L], preferred_element_type=jnp.float32)
                s_WHX += jnp.einsum("whr,xr->whx", q_rope_WHR, kv_XK[:, L:], preferred_element_type=jnp.float32)
                mask_WX = mine_W[:, None] & (key_pos_X[None, :] <= see_W[:, None])
                return fold(state, s_WHX * softmax_scale, mask_WX, kv_XK[:, None, :L], "whx,xhl->whl")

            top = jnp.max(jnp.where(mine_W, see_W, -1))
            init = (jnp.full((Ta, H), NEG_INF, jnp.float32), jnp.zeros((Ta, H), jnp.float32),
                    jnp.zeros((Ta, H, L), jnp.float32))
            m_WH, l_WH, o_WHL = jax.lax.fori_loop(0, (top + Kb) // Kb, key_block_of, init)
            o_WHL = o_WHL / jnp.where(l_WH > 0, l_WH, 1.0)[..., None]
            o_WHV = weight_einsum("whl,lhv->whv", o_WHL.astype(w_uv_LHV.dtype), w_uv_LHV,
                                  preferred_element_type=jnp.float32)
            new = (m_WH, l_WH, o_WHV * l_WH[..., None])
            return put(carry, at, mine_W, new)

        windows = jnp.where(on & (last >= first), (last - first) // Ta + 1, 0)
        return jax.lax.fori_loop(0, windows, window, carry)

    def sequence(b, carry):  # one row (a decoder), a few rows, many rows: the loops of the others run 0 times
        rows = jnp.sum((seq_T == b) & (see_T >= 0))  # (a lax.cond here would copy the weights it closes over
        # at every sequence)
        carry = absorbed(b, carry, 1, rows == 1)
        carry = absorbed(b, carry, Ta, (rows > 1) & (rows < absorb_below))
        return expanded(b, carry, rows >= absorb_below)

    init = (jnp.full((T, H), NEG_INF, jnp.float32), jnp.zeros((T, H), jnp.float32),
            jnp.zeros((T, H, V), jnp.float32))
    seqs = jnp.max(jnp.where(seq_T < B, seq_T, -1)) + 1  # the step's sequences (the rest of B is padding)
    return jax.lax.fori_loop(0, seqs, sequence, init)


def attend_split(q_nope_THN, q_rope_THR, kv_TK, kv_PSK, page_table_BN, seq_T, pos_T, w_kv_b_LHX, *,
                 kv_lora_rank: int, softmax_scale: float, skip_T=None, **blocks) -> jax.Array:
    """`attend_blocked`'s result, sized by the step's own rows: each row attends to the rows of its own
    sequence in this step (their entries kv_TK, as the cache holds them: one [T, H, T] piece, T keys
    expanded) and, in blocks, to its sequence's context cached before the step (`blocked_state` up to the
    sequence's first row here: no work for a fresh prompt); the two online-softmax states are merged.
    A sequence's rows in a step are consecutive positions (`jaxdp.batch.fill_pieces`), so the two parts
    cover its context once. What a step runs while its [T, H, T] scores stay under DENSE_MAX_SCORES.
    skip_T: rows whose cached context is not read (their output is the caller's: `MLA.attend_one_rows`)."""
    T, H, N = q_nope_THN.shape
    B, L = page_table_BN.shape[0], kv_lora_rank
    R = kv_TK.shape[-1] - L
    # head-major ([H, T, ...]): XLA:CPU runs a product batched over a middle axis (h of "thn,uhn->thu") several
    # times slower than over the leading one; the rope part rides in the same product as the nope part
    kv_HTY = weight_einsum("tl,lhy->thy", kv_TK[:, :L], w_kv_b_LHX).transpose(1, 0, 2)  # (W as stored: no copy)
    q_HTK = jnp.concatenate([q_nope_THN, q_rope_THR], -1).transpose(1, 0, 2)
    k_HTK = jnp.concatenate([kv_HTY[..., :N], jnp.broadcast_to(kv_TK[None, :, L:], (H, T, R))], -1)
    s_HTU = jnp.einsum("htk,huk->htu", q_HTK, k_HTK, preferred_element_type=jnp.float32) * softmax_scale
    mask_TU = (seq_T[:, None] == seq_T[None, :]) & (pos_T[None, :] <= pos_T[:, None])
    s_HTU = jnp.where(mask_TU, s_HTU, NEG_INF)
    m_HT = s_HTU.max(-1)
    p_HTU = jnp.where(mask_TU, jnp.exp(s_HTU - m_HT[..., None]), 0.0)
    o_HTV = jnp.einsum("htu,huv->htv", p_HTU.astype(kv_HTY.dtype), kv_HTY[..., N:],
                       preferred_element_type=jnp.float32)
    own = (m_HT.T, p_HTU.sum(-1).T, o_HTV.transpose(1, 0, 2))
    first_B = jnp.full((B + 1,), jnp.iinfo(jnp.int32).max, jnp.int32).at[seq_T].min(pos_T)
    see_T = first_B[seq_T] - 1
    if skip_T is not None:
        see_T = jnp.where(skip_T, -1, see_T)

    def cached(own):
        return merge(own, blocked_state(q_nope_THN, q_rope_THR, kv_PSK, page_table_BN, seq_T, pos_T, w_kv_b_LHX,
                                        kv_lora_rank=L, softmax_scale=softmax_scale, see_T=see_T, **blocks))

    # (XLA runs the first key block of the loops' sequences whatever their trip counts: skip them outright
    # when no row has cached context, a fresh prompt's step)
    state = jax.lax.cond(jnp.any(see_T >= 0), cached, lambda own: own, own)
    return finish(state).astype(w_kv_b_LHX.dtype)


def prompt_form(rows: int, heads: int, keys: int, latent: int, nope: int, rope: int, value: int,
                own_rows: bool = True) -> str:
    """Which form a prompt step of `rows` rows runs over `keys` (its sequences x their page table's capacity),
    `MLA.attend_expanded`: "dense" while its scores and its work (every key expanded by W_UK/W_UV, every row
    scored against every key) are small: it compiles faster than loops, but its work grows with the sequences
    the step is padded to and the width of their page table, not with the step's own rows; "split" while the
    rows' own [T, H, T] piece fits (own_rows: the step's fresh entries are at hand); "blocked" otherwise."""
    macs = keys * latent * heads * (nope + value) + rows * heads * keys * (nope + rope + value)
    if rows * heads * keys <= DENSE_MAX_SCORES and macs <= DENSE_MAX_MACS:
        return "dense"
    return "split" if own_rows and rows * heads * rows <= DENSE_MAX_SCORES else "blocked"


def merge(a, b):
    """Two online-softmax states of the same rows over disjoint keys -> the state over both."""
    m = jnp.maximum(a[0], b[0])
    sa, sb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, a[1] * sa + b[1] * sb, a[2] * sa[..., None] + b[2] * sb[..., None]


def attend_dense(q_nope_THN, q_rope_THR, kv_PSK, page_table_BN, seq_T, pos_T, w_kv_b_LHX, *, kv_lora_rank: int,
                 softmax_scale: float, sel_TK=None) -> jax.Array:
    """Every row against every sequence's whole context, masked ([T, H, B, C] scores, every context
    expanded): the reference for the blocked form, and what a step runs while those scores stay under
    DENSE_MAX_SCORES (64 MiB; a small step compiles faster in one piece than in loops)."""
    N = q_nope_THN.shape[-1]
    kv_BCK = kv_PSK[page_table_BN].reshape(page_table_BN.shape[0], -1, kv_PSK.shape[-1])
    B, C = kv_BCK.shape[:2]
    kv_BCHX = weight_einsum("bcl,lhx->bchx", kv_BCK[..., :kv_lora_rank], w_kv_b_LHX)
    s = jnp.einsum("thn,bchn->thbc", q_nope_THN, kv_BCHX[..., :N], preferred_element_type=jnp.float32)
    s += jnp.einsum("thr,bcr->thbc", q_rope_THR, kv_BCK[..., kv_lora_rank:], preferred_element_type=jnp.float32)
    mask_TC = jnp.arange(C)[None, :] <= pos_T[:, None]
    if sel_TK is not None:
        mask_TC &= jnp.zeros((len(pos_T), C), bool).at[jnp.arange(len(pos_T))[:, None], sel_TK].set(True)
    mask_TBC = (seq_T[:, None] == jnp.arange(B)[None, :])[:, :, None] & mask_TC[:, None, :]
    s = jnp.where(mask_TBC[:, None], s * softmax_scale, NEG_INF)
    p = jax.nn.softmax(s.reshape(*s.shape[:2], -1), -1).reshape(s.shape)
    return jnp.einsum("thbc,bchv->thv", p.astype(kv_BCHX.dtype), kv_BCHX[..., N:])


def attend_selected(q_latent_THL, q_rope_THR, kv_PSK, page_table_BN, seq_T, pos_T, sel_TK, *, kv_lora_rank: int,
                    softmax_scale: float, block: int | None = None) -> jax.Array:
    """Each row over its own selected latents (sel_TK: context positions; those past the row's own position
    are the top-k's filler), in blocks of rows -> [T, H, L] in latent space."""
    T, k = sel_TK.shape
    P, S, K = kv_PSK.shape
    B = page_table_BN.shape[0]
    block = block or max(1, min(T, SELECTED_FLOATS // (k * K)))
    flat_XK = kv_PSK.reshape(P * S, K)

    def rows(args):
        ql, qr, seq, pos, sel = args
        pages_WK = jnp.take_along_axis(page_table_BN[jnp.clip(seq, 0, B - 1)], sel // S, axis=1)
        kv_WKK = flat_XK[jnp.clip(pages_WK * S + sel % S, 0, P * S - 1)]
        return attend_latents(ql, qr, kv_WKK, sel <= pos[:, None], softmax_scale, kv_lora_rank)

    args = (q_latent_THL, q_rope_THR, seq_T, pos_T, sel_TK)
    if block >= T:
        return rows(args)
    pad = -T % block
    blocks = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, block, *a.shape[1:]) for a in args)
    out = jax.lax.map(rows, blocks)
    return out.reshape(-1, *out.shape[2:])[:T]
