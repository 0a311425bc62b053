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

NEG_INF = -1e30  # finite, so rows with an empty context stay NaN-free (their output is discarded)
ROW_BLOCK = 256  # rows scored against a key block at once
KEY_BLOCK = 512  # context positions expanded at once (rounded to whole pages)
ABSORBED_BLOCK = 16  # rows of a sequence with few rows, attended in the absorbed form at once
DENSE_MAX_SCORES = 1 << 24  # a step whose dense scores [T, H, B, C] are this small runs `attend_dense`
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
                   absorbed_block: int = ABSORBED_BLOCK) -> jax.Array:
    """Causal attention of each row over its sequence's cache (seq_T: B for padding rows) -> [T, H, V]."""
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
            kv_XHY = jnp.einsum("xl,lhy->xhy", kv_XK[:, :L], w_kv_b_LHX)
            k_nope_XHN, v_XHV = kv_XHY[..., :N], kv_XHY[..., N:]
            sees_T = (seq_T == b) & (pos_T >= j * Kb)  # b's rows that see part of this block
            first, last = span(sees_T)

            def window(r, carry):
                at, mine_W = window_of(sees_T, first + r * Tb, Tb)
                sl = lambda a: jax.lax.dynamic_slice_in_dim(a, at, Tb)  # noqa: E731
                s_WHX = jnp.einsum("whn,xhn->whx", sl(q_nope_THN), k_nope_XHN, preferred_element_type=jnp.float32)
                s_WHX += jnp.einsum("whr,xr->whx", sl(q_rope_THR), kv_XK[:, L:], preferred_element_type=jnp.float32)
                mask_WX = mine_W[:, None] & (key_pos_X[None, :] <= sl(pos_T)[:, None])
                old = tuple(sl(a) for a in carry)
                new = fold(old, s_WHX * softmax_scale, mask_WX, v_XHV, "whx,xhv->whv")
                return put(carry, at, mine_W, new)

            windows = jnp.where(last >= first, (last - first) // Tb + 1, 0)
            return jax.lax.fori_loop(0, windows, window, carry)

        top = jnp.max(jnp.where(seq_T == b, pos_T, -1))  # the highest position among b's rows
        return jax.lax.fori_loop(0, jnp.where(on, (top + Kb) // Kb, 0), key_block_of, carry)

    def absorbed(b, carry, Ta, on):
        """Each window of Ta of b's rows over b's latents (q . W_UK, scores over the latents, W_UV after):
        nothing expanded. Writes the rows' finished outputs (sum 1)."""
        mine_T = seq_T == b
        first, last = span(mine_T)

        def window(r, carry):
            at, mine_W = window_of(mine_T, first + r * Ta, Ta)
            sl = lambda a: jax.lax.dynamic_slice_in_dim(a, at, Ta)  # noqa: E731
            q_latent_WHL = jnp.einsum("whn,lhn->whl", sl(q_nope_THN), w_uk_LHN)
            q_rope_WHR, pos_W = sl(q_rope_THR), sl(pos_T)

            def key_block_of(j, state):
                kv_XK, key_pos_X = keys(b, j)
                s_WHX = jnp.einsum("whl,xl->whx", q_latent_WHL, kv_XK[:, :L], preferred_element_type=jnp.float32)
                s_WHX += jnp.einsum("whr,xr->whx", q_rope_WHR, kv_XK[:, L:], preferred_element_type=jnp.float32)
                mask_WX = mine_W[:, None] & (key_pos_X[None, :] <= pos_W[:, None])
                return fold(state, s_WHX * softmax_scale, mask_WX, kv_XK[:, None, :L], "whx,xhl->whl")

            top = jnp.max(jnp.where(mine_W, pos_W, -1))
            init = (jnp.full((Ta, H), NEG_INF, jnp.float32), jnp.zeros((Ta, H), jnp.float32),
                    jnp.zeros((Ta, H, L), jnp.float32))
            _, l_WH, o_WHL = jax.lax.fori_loop(0, (top + Kb) // Kb, key_block_of, init)
            o_WHL = o_WHL / jnp.where(l_WH > 0, l_WH, 1.0)[..., None]
            o_WHV = jnp.einsum("whl,lhv->whv", o_WHL.astype(w_uv_LHV.dtype), w_uv_LHV,
                               preferred_element_type=jnp.float32)
            new = (jnp.zeros((Ta, H), jnp.float32), jnp.ones((Ta, H), jnp.float32), o_WHV)
            return put(carry, at, mine_W, new)

        windows = jnp.where(on & (last >= first), (last - first) // Ta + 1, 0)
        return jax.lax.fori_loop(0, windows, window, carry)

    def sequence(b, carry):  # one row (a decoder), a few rows, many rows: the loops of the others run 0 times
        rows = jnp.sum(seq_T == b)  # (a lax.cond here would copy the weights it closes over at every sequence)
        carry = absorbed(b, carry, 1, rows == 1)
        carry = absorbed(b, carry, Ta, (rows > 1) & (rows < absorb_below))
        return expanded(b, carry, rows >= absorb_below)

    init = (jnp.full((T, H), NEG_INF, jnp.float32), jnp.zeros((T, H), jnp.float32),
            jnp.zeros((T, H, V), jnp.float32))
    _, l_TH, o_THV = jax.lax.fori_loop(0, B, sequence, init)
    return (o_THV / jnp.where(l_TH > 0, l_TH, 1.0)[..., None]).astype(w_kv_b_LHX.dtype)


def attend_dense(q_nope_THN, q_rope_THR, kv_PSK, page_table_BN, seq_T, pos_T, w_kv_b_LHX, *, kv_lora_rank: int,
                 softmax_scale: float, sel_TK=None) -> jax.Array:
    """Every row against every sequence's whole context, masked ([T, H, B, C] scores, every context
    expanded): the reference for the blocked form, and what a step runs while those scores stay under
    DENSE_MAX_SCORES (64 MiB; a small step compiles faster in one piece than in loops)."""
    N = q_nope_THN.shape[-1]
    kv_BCK = kv_PSK[page_table_BN].reshape(page_table_BN.shape[0], -1, kv_PSK.shape[-1])
    B, C = kv_BCK.shape[:2]
    kv_BCHX = jnp.einsum("bcl,lhx->bchx", kv_BCK[..., :kv_lora_rank], w_kv_b_LHX)
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


def attend_latents(q_latent_BHL, q_rope_BHR, kv_BXK, valid_BX, softmax_scale, kv_lora_rank):
    """Absorbed attention of each row's query over its cache entries kv_BXK (the valid ones)."""
    latent_BXL, k_rope_BXR = kv_BXK[..., :kv_lora_rank], kv_BXK[..., kv_lora_rank:]
    s_BHX = jnp.einsum("bhl,bxl->bhx", q_latent_BHL, latent_BXL, preferred_element_type=jnp.float32)
    s_BHX += jnp.einsum("bhr,bxr->bhx", q_rope_BHR, k_rope_BXR, preferred_element_type=jnp.float32)
    s_BHX = jnp.where(valid_BX[:, None, :], s_BHX * softmax_scale, NEG_INF)
    p_BHX = jax.nn.softmax(s_BHX, axis=-1)
    return jnp.einsum("bhx,bxl->bhl", p_BHX.astype(latent_BXL.dtype), latent_BXL,
                      preferred_element_type=jnp.float32).astype(latent_BXL.dtype)  # (XLA:CPU: bf16 fast only so)
