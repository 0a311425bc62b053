"""The DeepSeek-V3 decoder: embedding, a stack of dense layers and a stack of MoE layers, each run
with `lax.scan`, the final norm and the LM head.

The model knows nothing of requests and nothing of devices. Where its rows meet the rest of the mesh
it calls the `comm` object it is given (see `jaxdp.parallel.places`): between attention and the
feed-forward (`attn_to_ffn`, `ffn_to_attn`), around the feed-forward (`moe`, `dense_ffn`: the gather
and the return) and for the LM head (`lm_head`). On one device those are plain calls.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.indexer import selection_size
from jaxdp.model.layers import AXES, MLP, init_normal, param, rms_norm
from jaxdp.model.mla import MLA, AttnBatch, IndexState
from jaxdp.model.moe import MoE
from jaxdp.model.stacked import InStack, read_in_place


class Comm(Protocol):
    """The four places, as the model sees them (the agreement happens on the host, before the step).

    `attn_to_ffn` adds attention's (possibly partial) output to the residual and applies the FFN norm,
    returning the rows this device carries into the FFN; `ffn_to_attn` adds the FFN output and brings
    back the rows attention needs. Between them the residual may live in a different row layout.
    """

    def attn_to_ffn(self, a_TD, x_TD, norm_w, eps) -> tuple[jax.Array, jax.Array]: ...
    def ffn_to_attn(self, y, x) -> jax.Array: ...
    def moe(self, h_TD: jax.Array, valid_T: jax.Array, moe: MoE) -> tuple[jax.Array, jax.Array]: ...
    def dense_ffn(self, h_TD: jax.Array, valid_T: jax.Array, mlp: MLP) -> jax.Array: ...
    def lm_head(self, h_BD: jax.Array, w_DV: jax.Array) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One of two micro-batches of a step (two-batch overlap, `jaxdp.parallel.tbo`): the step's rows it carries
    (rows_M [M]; T for a row it does not carry), their valid flags, attention's view of them, and the comm at its
    row count."""

    rows_M: jax.Array
    valid_M: jax.Array
    batch: AttnBatch
    comm: Comm


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype, is_moe: bool):
        self.attn_norm = param(jnp.ones((cfg.hidden_size,), dtype), ("embed",))
        self.attn = MLA(cfg, rngs, dtype)
        self.ffn_norm = param(jnp.ones((cfg.hidden_size,), dtype), ("embed",))
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.ffn = MoE(cfg, rngs, dtype) if is_moe else MLP(D, F, rngs, dtype)


def _layer_stack(cfg: ModelConfig, n: int, rngs: nnx.Rngs, dtype, is_moe: bool) -> DecoderLayer | None:
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)  # every weight's logical axes get the stack's "layers" in front
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers", AXES: "layers"})
    def create(r: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, r, dtype, is_moe)

    return create(rngs)


class DeepseekV3(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed_VD = param(jax.random.normal(rngs.params(), (V, D), jnp.float32).astype(dtype),
                              ("vocab_in", "embed"))
        self.dense_layers = _layer_stack(cfg, cfg.num_dense_layers, rngs, dtype, is_moe=False)
        self.moe_layers = _layer_stack(cfg, cfg.num_moe_layers, rngs, dtype, is_moe=True)
        self.final_norm = param(jnp.ones((D,), dtype), ("embed",))
        self.lm_head_DV = None if cfg.tie_word_embeddings else param(init_normal(rngs, (D, V), dtype, D),
                                                                     ("embed", "vocab_out"))

    def lm_head_weight(self) -> jax.Array:
        return self.embed_VD[...].T if self.lm_head_DV is None else self.lm_head_DV[...]

    def __call__(self, tokens_T, valid_T, batch: AttnBatch, kv_cache: dict, logits_idx_B, comm: Comm, *,
                 absorbed: bool, decode_kernel=None, return_hidden: bool = False, rows_by_layer: bool = False,
                 micro: tuple[MicroBatch, MicroBatch] | None = None):
        """One step over the rows of this device.

        kv_cache: {"dense": [Ld, P, S, K], "moe": [Lm, P, S, K]}, plus with DSA (`cfg.index_topk`) the
        index keys {"dense_index": [Ld, P, S, E], "moe_index": ...}; or None: no cache, each sequence is
        the step's rows alone (training; `batch` needs only positions_T and seq_T). Returns
        (logits [B, V] in float32 for the rows `logits_idx_B`, the updated cache (None without one),
        rows received per expert summed over MoE layers [E_local]; with `rows_by_layer`, what `comm.moe` returned
        for each MoE layer, stacked [L, ...], unsummed); with `return_hidden`, also the final
        normed hidden state of every row [T, D] (what the MTP layer reads, `jaxdp.model.mtp`).
        micro: two micro-batches that split the rows (two-batch overlap): each layer runs them as independent
        chains (`_run_stack_tbo`), and so do the final norm and the LM head (`_lm_head_tbo`); `batch` and `comm`
        serve no layer.
        """
        cfg = self.cfg
        with jax.named_scope("embedding"):  # (the scopes name the parts of `python -m jaxdp.bench.profile`)
            x_TD = self.embed_VD[...][tokens_T]
        new_cache = None if kv_cache is None else dict(kv_cache)
        expert_rows = jnp.zeros((0,), jnp.int32)
        sel_TK = _no_selection(cfg, tokens_T.shape[0], batch, kv_cache)  # carried across both stacks
        full = cfg.indexer_full
        stacks = (("dense", self.dense_layers, 0, cfg.num_dense_layers),
                  ("moe", self.moe_layers, cfg.num_dense_layers, cfg.num_layers))
        if micro is not None:
            if cfg.index_topk or kv_cache is None:
                raise ValueError("two-batch overlap needs a KV cache and a model without DSA's indexer; run this "
                                 "step whole.")
            x_MD = [jnp.take(x_TD, mb.rows_M, axis=0, mode="fill", fill_value=0) for mb in micro]
        for name, stack, first, end in stacks:
            if stack is None:
                continue
            if micro is not None:
                x_MD, new_cache[name], rows_LE = _run_stack_tbo(stack, x_MD, micro, kv_cache[name], absorbed,
                                                                decode_kernel, is_moe=name == "moe")
                if name == "moe":
                    expert_rows = rows_LE if rows_by_layer else jax.tree.map(lambda a: a.sum(0), rows_LE)
                continue
            kv = None if kv_cache is None else kv_cache[name]
            index = None
            if cfg.index_topk:
                keys = None if kv_cache is None else kv_cache[f"{name}_index"]
                index = (keys, sel_TK, full[first:end])
            x_TD, kv, index, rows_LE = _run_stack(stack, x_TD, valid_T, batch, kv, comm, absorbed, decode_kernel,
                                                  is_moe=name == "moe", index=index)
            if new_cache is not None:
                new_cache[name] = kv
                if index is not None:
                    new_cache[f"{name}_index"] = index[0]
            if index is not None:
                sel_TK = index[1]
            if name == "moe":
                expert_rows = rows_LE if rows_by_layer else rows_LE.sum(0)
        if micro is not None:  # the final norm and LM head per micro-batch, as SGLang's TBO runs them
            logits_BV = _lm_head_tbo(x_MD, micro, logits_idx_B, self.final_norm[...], cfg.rms_norm_eps,
                                     self.lm_head_weight())
            if return_hidden:  # the rows back in the step's order (the rows a micro-batch does not carry: dropped)
                x_TD = jnp.zeros_like(x_TD)
                for mb, x in zip(micro, x_MD, strict=True):
                    x_TD = x_TD.at[mb.rows_M].set(x, mode="drop")
        else:
            with jax.named_scope("lm_head"):
                h_BD = rms_norm(x_TD[logits_idx_B], self.final_norm[...], cfg.rms_norm_eps)
                logits_BV = _lm_head(comm, h_BD, self.lm_head_weight())
        if return_hidden:
            return logits_BV, new_cache, expert_rows, rms_norm(x_TD, self.final_norm[...], cfg.rms_norm_eps)
        return logits_BV, new_cache, expert_rows


def _lm_head(comm: Comm, h_BD, w_DV) -> jax.Array:
    """Full-vocab float32 logits [B, V] of the rows h_BD (normed), through the comm's LM head."""
    one = h_BD.shape[0] == 1 and h_BD.dtype == jnp.bfloat16  # XLA:CPU: no fast one-row bf16 product
    h_BD = jnp.concatenate([h_BD, jnp.zeros_like(h_BD)]) if one else h_BD  # (jaxdp.model.layers.dot)
    logits_BV = comm.lm_head(h_BD, w_DV)
    return logits_BV[:1] if one else logits_BV


def _lm_head_tbo(x_MD: list, micro: tuple[MicroBatch, MicroBatch], logits_idx_B, norm_w, eps, w_DV) -> jax.Array:
    """The final norm and the LM head of each micro-batch on its own (two-batch overlap), so that one micro-batch's
    head runs while the other's last combine is in flight: each takes the logits rows that fall among its rows (at
    most min(B, M), in order; a step's padding entries, which all name row 0, may overflow and read another row's
    logits), and the logits come back in the step's order [B, V]."""
    B = logits_idx_B.shape[0]
    picked = []
    for mb, x_MD_k in zip(micro, x_MD, strict=True):
        M = x_MD_k.shape[0]
        K = min(B, M)
        pos_B = logits_idx_B - mb.rows_M[0]  # (a micro-batch's rows are consecutive; T where it has none)
        mine_B = (pos_B >= 0) & (pos_B < M) & (jnp.take(mb.rows_M, jnp.clip(pos_B, 0, M - 1)) == logits_idx_B)
        order_K = jnp.argsort(~mine_B, stable=True)[:K]  # its logits rows first, in the step's order
        with jax.named_scope(f"lm_head_mb{0 if mb is micro[0] else 1}"):
            h_KD = rms_norm(x_MD_k[jnp.clip(pos_B[order_K], 0, M - 1)], norm_w, eps)
            logits_KV = _lm_head(mb.comm, h_KD, w_DV)
        slot_B = jnp.clip(jnp.cumsum(mine_B) - 1, 0, K - 1)
        picked.append((mine_B, logits_KV[slot_B]))
    (mine0_B, logits0_BV), (_, logits1_BV) = picked
    return jnp.where(mine0_B[:, None], logits0_BV, logits1_BV)


def _no_selection(cfg: ModelConfig, T: int, batch: AttnBatch, kv_cache) -> jax.Array | None:
    """The DSA selection a step starts from ([T, index_topk] zeros; layer 0 is always a full one), or None
    when its context fits in index_topk and attention stays dense."""
    context = T if kv_cache is None else batch.page_table_BN.shape[1] * kv_cache["dense"].shape[2]
    k = selection_size(cfg, context)
    return jnp.zeros((T, k), jnp.int32) if k else None


def _run_stack(stack: DecoderLayer, x_TD, valid_T, batch, kv_LPSK, comm: Comm, absorbed, decode_kernel,
               is_moe: bool, index=None):
    """Run a stack of layers under lax.scan. The whole stack's cache is carried through the scan as one
    pool of L * P pages (layer i owns pages i*P ..), so each layer scatters its new entries in place
    instead of the scan copying the cache out as a new stacked array. kv_LPSK None: no cache.
    index (DSA): (index keys [L, P, S, E] or None, the selection carried in, per-layer "full" flags: a
    tuple of L bools); the same comes back with the stack's keys and the last selection.
    The parameters a layer's kernels read in place (`jaxdp.model.stacked`: the modules say which, by their
    backend) are not sliced: each layer gets their whole stack and its index."""
    graphdef, whole, state = nnx.split(stack, read_in_place(stack), ...)
    eps = stack.attn.cfg.rms_norm_eps
    L, P, S, K = kv_LPSK.shape if kv_LPSK is not None else (jax.tree.leaves((state, whole))[0].shape[0], 0, 0, 0)
    keys_LPSE, sel_TK, full = index if index is not None else (None, None, (True,) * L)
    # a stack whose layers all run their indexer needs no per-layer switch (V3.2, GLM-5's dense stack)
    full_L = None if all(full) else jnp.asarray(full)
    E = 0 if keys_LPSE is None else keys_LPSE.shape[-1]

    def body(carry, xs):
        x_TD, kv_PSK, idx = carry
        layer_state, i, full_i = xs
        layer = nnx.merge(graphdef, jax.tree.map(lambda a: InStack(a, i), whole), layer_state)
        h_TD = rms_norm(x_TD, layer.attn_norm[...], eps)
        a_TD, kv_PSK, idx = layer.attn(h_TD, kv_PSK, batch, absorbed=absorbed, decode_kernel=decode_kernel,
                                       page_offset=i * P, pages_per_layer=P, index=idx,
                                       index_full=True if full_i is None else full_i)
        x_rows, h_rows = comm.attn_to_ffn(a_TD, x_TD, layer.ffn_norm[...], eps)
        if is_moe:
            y_rows, rows_E = comm.moe(h_rows, valid_T, layer.ffn)
        else:
            with jax.named_scope("dense_ffn"):
                y_rows, rows_E = comm.dense_ffn(h_rows, valid_T, layer.ffn), jnp.zeros((0,), jnp.int32)
        return (comm.ffn_to_attn(y_rows, x_rows), kv_PSK, idx), rows_E

    kv = None if kv_LPSK is None else kv_LPSK.reshape(L * P, S, K)
    idx = None
    if index is not None:
        idx = IndexState(None if keys_LPSE is None else keys_LPSE.reshape(L * P, S, E), sel_TK)
    (x_TD, kv, idx), rows_LE = jax.lax.scan(body, (x_TD, kv, idx), (state, jnp.arange(L), full_L))
    if idx is not None:
        keys = None if idx.keys_PSE is None else idx.keys_PSE.reshape(L, P, S, E)
        index = (keys, idx.sel_TK, full)
    return x_TD, None if kv is None else kv.reshape(L, P, S, K), index, rows_LE


def _run_stack_tbo(stack: DecoderLayer, x_MD: list, micro: tuple[MicroBatch, MicroBatch], kv_LPSK, absorbed,
                   decode_kernel, is_moe: bool):
    """`_run_stack` for two micro-batches, software-pipelined across the layer boundary as SGLang's TBO stages
    are: micro-batch 1 runs half a layer behind micro-batch 0. Iteration i of the scan runs
        mb0: attention(i) -> [dispatch / gather] -> experts(i) -> [combine / return]
        mb1: [dispatch / gather] -> experts(i) -> [combine / return] -> attention(i + 1)
    whose only link is the cache (attention's writes, disjoint sequences), so each collective of one micro-batch
    has the other's compute to hide behind: mb1's dispatch under mb0's attention, mb0's dispatch under mb1's
    experts, mb1's combine under mb0's experts, mb0's combine under mb1's attention. Micro-batch 1's attention
    of layer 0 runs before the scan, and both micro-batches' last layer after it.
    Returns ([x0, x1], the stack's cache, rows per expert of both micro-batches per layer, stacked)."""
    graphdef, whole, state = nnx.split(stack, read_in_place(stack), ...)
    eps = stack.attn.cfg.rms_norm_eps
    L, P, S, K = kv_LPSK.shape
    mb0, mb1 = micro

    def layer_at(i):
        pick = (lambda a: a[i]) if isinstance(i, int) else (lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False))
        return nnx.merge(graphdef, jax.tree.map(lambda a: InStack(a, i), whole), jax.tree.map(pick, state))

    def attention(layer, x_MD, kv_PSK, mb: MicroBatch, i):
        with jax.named_scope(scope(mb)):
            return _attention(layer, x_MD, kv_PSK, mb, i)

    def scope(mb: MicroBatch) -> str:  # (what the overlap report reads in XLA's schedule, jaxdp.planner.tbo_report)
        return f"tbo_mb{0 if mb is mb0 else 1}"

    def _attention(layer, x_MD, kv_PSK, mb: MicroBatch, i):
        h_MD = rms_norm(x_MD, layer.attn_norm[...], eps)
        a_MD, kv_PSK, _ = layer.attn(h_MD, kv_PSK, mb.batch, absorbed=absorbed, decode_kernel=decode_kernel,
                                     page_offset=i * P, pages_per_layer=P)
        return a_MD, kv_PSK

    def ffn(layer, a_MD, x_MD, mb: MicroBatch):
        with jax.named_scope(scope(mb)):
            return _ffn(layer, a_MD, x_MD, mb)

    def _ffn(layer, a_MD, x_MD, mb: MicroBatch):
        x_rows, h_rows = mb.comm.attn_to_ffn(a_MD, x_MD, layer.ffn_norm[...], eps)
        if is_moe:
            y_rows, rows_E = mb.comm.moe(h_rows, mb.valid_M, layer.ffn)
        else:
            with jax.named_scope("dense_ffn"):
                y_rows, rows_E = mb.comm.dense_ffn(h_rows, mb.valid_M, layer.ffn), jnp.zeros((0,), jnp.int32)
        return mb.comm.ffn_to_attn(y_rows, x_rows), rows_E

    def both_ffn(layer, a0, x0, a1, x1):
        x1, rows1 = ffn(layer, a1, x1, mb1)
        x0, rows0 = ffn(layer, a0, x0, mb0)
        return x0, x1, jax.tree.map(jnp.add, rows0, rows1)

    def body(carry, i):
        x0, x1, a1, kv = carry
        layer = layer_at(i)
        a0, kv = attention(layer, x0, kv, mb0, i)
        x0, x1, rows = both_ffn(layer, a0, x0, a1, x1)
        a1, kv = attention(layer_at(i + 1), x1, kv, mb1, i + 1)
        return (x0, x1, a1, kv), rows

    x0, x1 = x_MD
    kv = kv_LPSK.reshape(L * P, S, K)
    a1, kv = attention(layer_at(0), x1, kv, mb1, 0)
    rows_LE = None
    if L > 1:
        (x0, x1, a1, kv), rows_LE = jax.lax.scan(body, (x0, x1, a1, kv), jnp.arange(L - 1))
    last = layer_at(L - 1)
    a0, kv = attention(last, x0, kv, mb0, L - 1)
    x0, x1, rows = both_ffn(last, a0, x0, a1, x1)
    rows = jax.tree.map(lambda a: a[None], rows)
    if rows_LE is not None:
        rows = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), rows_LE, rows)
    return [x0, x1], kv.reshape(L, P, S, K), rows


def empty_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> dict:
    """A zeroed paged latent cache for every layer (one extra page past the end is never needed:
    padding tokens write out of range and are dropped)."""
    shape = (num_pages, page_size, cfg.kv_cache_dim)
    cache = {
        "dense": jnp.zeros((cfg.num_dense_layers, *shape), dtype),
        "moe": jnp.zeros((cfg.num_moe_layers, *shape), dtype),
    }
    if cfg.index_topk:  # DSA: one index key per token per layer, in the same pages
        for name, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)):
            cache[f"{name}_index"] = jnp.zeros((n, num_pages, page_size, cfg.index_key_dim), dtype)
    return cache
