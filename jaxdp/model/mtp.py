"""The multi-token-prediction (MTP, "NextN") layer of DeepSeek-V3 and GLM-5: the draft model of speculative
decoding, as the model's own module.

What goes in, as the two serving stacks define it (read for this module; no code taken):

- vLLM `vllm/model_executor/models/deepseek_mtp.py` (`DeepSeekMultiTokenPredictorLayer.forward`, rev.
  03356f8): `eh_proj(cat([enorm(embed(token)), hnorm(previous_hidden)]))` -- the embedding first, the
  hidden state second; the embedding of rows at position 0 is set to zero ("not needed by MTP"); the
  decoder layer (`DeepseekV2DecoderLayer`: MLA + MoE) runs with `residual=None` and its (out, residual)
  are summed: an ordinary pre-norm layer whose output is the residual stream. `compute_logits` applies
  `shared_head.norm`, then `shared_head.head`. The layers sit at `num_hidden_layers + k`; draft step s
  uses layer `s % num_nextn_predict_layers`.
- SGLang `python/sglang/srt/models/deepseek_nextn.py` (`DeepseekModelNextN.forward`, rev. c28bdc9): the
  same concatenation order, no masking at position 0; `shared_head.norm(hidden, residual)` is the fused
  add-then-RMSNorm, i.e. the same sum. Its weight loader (`deepseek_common/deepseek_weight_loader.py`)
  reads `model.layers.{num_hidden_layers}.*`, supports exactly one NextN layer, and skips the layer's
  `shared_head.head` and `embed_tokens` ("use shared head and embed weights from target model"); for a
  ModelOpt NVFP4 DeepSeek checkpoint it drops the quantization of the NextN layer (stored unquantized).
- The hidden state fed in is the target's final hidden state *after* its final RMSNorm (`model.norm`):
  SGLang's `LogitsProcessor` stores the hidden states it is handed (`layers/logits_processor.py`,
  `hidden_states_to_store`), which `DeepseekV2Model.forward` returns after `self.norm`; vLLM's
  `EagleProposer.propose` (`v1/spec_decode/eagle.py`) feeds the target model's forward output, also normed.
- Rows: the draft pass over a prompt (or over the rows a verify step accepted) takes, at row i, the
  target's hidden state of position i and the token of position i + 1 (the inputs shifted left by one, the
  last row getting the token the target just sampled), at position i (vLLM: `input_ids[:-1] =
  target_token_ids[1:]`, `input_ids[last] = next_token_ids`, positions = the target's). So the draft KV of
  position i holds what the MTP layer saw there. Each later draft step is one row per request at the next
  position, with the token just drafted. The hidden state fed to those steps differs between the two:
  SGLang feeds the draft model's own captured hidden state (after `shared_head.norm`); vLLM feeds its
  pre-norm output (for `deepseek_mtp` the target's last hidden state once more on the second step). This
  module returns the pre-norm rows (`hidden_TD`) and offers `shared_norm` for SGLang's choice.
- GLM-5 (`glm_moe_dsa`): the same layer with its DSA indexer; a draft pass has no earlier layer whose
  selection it could share, so the MTP layer always runs its own indexer ("full").

Choices made here:
- The embedding and the output head are the main model's, passed in (`embed_VD`, `head_DV`): DeepSeek-V3
  shares both between the model and its MTP module (its checkpoint stores copies under the layer's
  `embed_tokens` and `shared_head.head`), and SGLang uses the target's. Holding copies would cost two
  vocab x hidden matrices per device. The loader compares stored copies with the main model's (first and
  last rows) and warns when they differ.
- `mask_position0` (default off, SGLang's behaviour) gives vLLM's zeroed embedding at position 0.
- A checkpoint whose config.json declares `num_nextn_predict_layers` but lacks the layer's tensors (quantized
  re-uploads often drop it) still serves the main model, which never reads them; asking it for its MTP layer
  (`jaxdp.model.loader.build_mtp`, or `check_mtp_checkpoint` before anything loads) is refused in one sentence.
  Refusing the whole checkpoint would break serving without speculation; loading without MTP would hide why
  speculation is off.
- The decoder layer is the project's own (`jaxdp.model.decoder.DecoderLayer`: MLA, MoE, the `comm` places),
  held as a stack of one MoE layer named like the main model's (`moe_layers`), so that the layer runs
  through the same `lax.scan` step code, and the loader's tensor sources, the sharding rules, block-FP8
  and NVFP4 apply to it unchanged. Its latent cache (the draft KV) has the main cache's format with one
  layer: {"moe": [1, P, S, K]} (plus "moe_index" with DSA), see `empty_draft_cache`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.decoder import Comm, _layer_stack, _run_stack
from jaxdp.model.fp8 import to_fp8
from jaxdp.model.indexer import selection_size
from jaxdp.model.layers import init_normal, param, rms_norm
from jaxdp.model.mla import AttnBatch
from jaxdp.model.quant import quantize_experts


def mtp_layer_is_moe(cfg: ModelConfig) -> bool:
    """The MTP layer sits at index num_layers: an MoE layer unless every layer of the model is dense."""
    return cfg.num_layers >= cfg.first_k_dense_replace and cfg.n_routed_experts > 0


class MTPLayer(nnx.Module):
    """One MTP layer: enorm, hnorm, eh_proj, a decoder layer, shared_head.norm (the head is the model's)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        D = cfg.hidden_size
        self.enorm = param(jnp.ones((D,), dtype), ("embed",))
        self.hnorm = param(jnp.ones((D,), dtype), ("embed",))
        # X = [embedding | hidden]
        self.w_eh_XD = param(init_normal(rngs, (2 * D, D), dtype, 2 * D), ("embed_pair", "embed"))
        moe = mtp_layer_is_moe(cfg)
        self.dense_layers = None if moe else _layer_stack(cfg, 1, rngs, dtype, is_moe=False)
        self.moe_layers = _layer_stack(cfg, 1, rngs, dtype, is_moe=True) if moe else None
        self.shared_head_norm = param(jnp.ones((D,), dtype), ("embed",))

    @property
    def stack_name(self) -> str:
        return "moe" if self.moe_layers is not None else "dense"

    def shared_norm(self, hidden_TD: jax.Array) -> jax.Array:
        return rms_norm(hidden_TD, self.shared_head_norm[...], self.cfg.rms_norm_eps)

    def __call__(self, tokens_T, hidden_TD, valid_T, batch: AttnBatch, kv_cache: dict | None, logits_idx_B,
                 comm: Comm, embed_VD: jax.Array, head_DV: jax.Array, *, absorbed: bool, decode_kernel=None,
                 mask_position0: bool = False):
        """One draft step over the rows of this device, in the main model's step conventions.

        tokens_T: the token of each row (position + 1's, see the module docstring); hidden_TD: the target's
        final normed hidden state of each row (or the previous draft step's, as the caller chooses);
        kv_cache: the draft KV (`empty_draft_cache`), or None (no cache: each sequence is the step's rows).
        embed_VD, head_DV: the main model's embedding and LM head (`DeepseekV3.lm_head_weight()`).
        Returns (logits [B, V] float32 of the rows `logits_idx_B`, hidden_TD: the layer's pre-norm output of
        every row, the updated draft KV (None without one), rows received per expert [E_local]).
        """
        cfg = self.cfg
        e_TD = embed_VD[tokens_T].astype(hidden_TD.dtype)
        if mask_position0:
            e_TD = jnp.where((batch.positions_T == 0)[:, None], jnp.zeros_like(e_TD), e_TD)
        eps = cfg.rms_norm_eps
        eh_TX = jnp.concatenate([rms_norm(e_TD, self.enorm[...], eps), rms_norm(hidden_TD, self.hnorm[...], eps)], -1)
        x_TD = eh_TX @ self.w_eh_XD[...].astype(eh_TX.dtype)
        name = self.stack_name
        stack = self.moe_layers if name == "moe" else self.dense_layers
        kv = None if kv_cache is None else kv_cache[name]
        index = None
        if cfg.index_topk:  # DSA: the MTP layer runs its own indexer over the draft KV's index keys
            keys = None if kv_cache is None else kv_cache[f"{name}_index"]
            context = x_TD.shape[0] if kv_cache is None else batch.page_table_BN.shape[1] * kv.shape[2]
            k = selection_size(cfg, context)
            index = (keys, jnp.zeros((x_TD.shape[0], k), jnp.int32) if k else None, (True,))
        x_TD, kv, index, rows_LE = _run_stack(stack, x_TD, valid_T, batch, kv, comm, absorbed, decode_kernel,
                                              is_moe=name == "moe", index=index)
        new_cache = None
        if kv_cache is not None:
            new_cache = {**kv_cache, name: kv}
            if index is not None:
                new_cache[f"{name}_index"] = index[0]
        logits_BV = comm.lm_head(self.shared_norm(x_TD[logits_idx_B]), head_DV)
        rows_E = rows_LE.sum(0) if name == "moe" else jnp.zeros((0,), jnp.int32)
        return logits_BV, x_TD, new_cache, rows_E


def empty_draft_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> dict:
    """A zeroed draft KV: the main cache's format (`decoder.empty_kv_cache`) for the one MTP layer."""
    name = "moe" if mtp_layer_is_moe(cfg) else "dense"
    cache = {name: jnp.zeros((1, num_pages, page_size, cfg.kv_cache_dim), dtype)}
    if cfg.index_topk:
        cache[f"{name}_index"] = jnp.zeros((1, num_pages, page_size, cfg.index_key_dim), dtype)
    return cache


def mtp_prefix(cfg: ModelConfig, k: int = 0) -> str:
    """The checkpoint prefix of MTP layer k: `model.layers.{num_hidden_layers + k}`."""
    return f"model.layers.{cfg.num_layers + k}"


def apply_mtp_quantization(mtp: MTPLayer, method: str | None) -> MTPLayer:
    """`jaxdp.model.quant.apply_quantization` for the MTP layer: its experts to NVFP4 when asked, its decoder
    layer's Linear weights to block FP8 when the config has an FP8 block (eh_proj stays dense, as stored)."""
    quantize_experts(mtp, method)
    if mtp.cfg.fp8_block:
        to_fp8(mtp, mtp.cfg.fp8_block[0], mtp.enorm.get_value().dtype)
    return mtp
