"""Weights per device by component, and KV bytes per token, for a ModelConfig under a Layout.

Pure Python (no JAX). The placement rules are SGLang's for the DeepSeek-V2/V3 family (jaxdp's Layout
mirrors them); docs/plan.md lists each rule with its source. In short, for a world of N = dp*tp devices:
- attention: q_a_proj and kv_a_proj_with_mqa whole on every device (ReplicatedLinear); q_b_proj,
  kv_b_proj and o_proj split over the attention group's tp (whole under dp=N, 1/N under tp=N);
- absorbed copies: SGLang keeps kv_b_proj for prompts and builds contiguous copies w_kc, w_vc of its two
  halves for decoding, so kv_b_proj's bytes are held twice (`absorbed_copy=False` for a runtime that
  reads kv_b_proj directly);
- DSA indexer (wq_b, wk, weights_proj, k_norm), router, norms: whole on every device;
- routed experts: moe=tp, 1/N of every expert per device; moe=ep, N-th of the experts whole per device;
- shared expert: split over N like the experts under moe=tp, whole on every device under moe=ep;
- dense FFN layers: split over N (tp over the group when dp=1), whole with dense_replicated;
- embedding: vocab-split over the devices under plain TP (dp=1), whole on every device under attention DP
  (VocabParallelEmbedding(enable_tp=not dp_attention));
- LM head: vocab-split over N; with dp_lm_head split over the group's tp only (whole when tp=1).
`placement="jaxdp"` follows jaxdp's own table (jaxdp/parallel/sharding.py) where it differs: no
absorbed copies (decoding reads slices of kv_b), the embedding whole on every device in every layout, and
the LM head whole on every device with dp_lm_head whatever the group's tp.
Dtypes: routed experts in `expert_dtype` (nvfp4 = 4 bits + one E4M3 scale per 16 values + two fp32
scalars per matrix, i.e. 4.5 bits per weight, ModelOpt's NVFP4 experts with every other weight bf16).
fp8 is a DeepSeek block-FP8 checkpoint (`quantization_config.quant_method == "fp8"`, DeepSeek-V3/R1's
own): every Linear of the layers is stored FP8, 1 byte + one fp32 scale per 128x128 block (DeepSeek's
inference model.py sets `Linear.dtype = float8_e4m3fn` for all of them), i.e. the attention projections,
the shared expert and the dense layers as well as the routed experts; the router, embedding, LM head,
norms and the DSA indexer stay bf16 (as jaxdp's loader holds them, `jaxdp.model.fp8.FP8_WEIGHTS`), and
SGLang's absorbed copies are bf16 (its post_load_weights dequantizes kv_b_proj for w_kc/w_vc). The
router's correction bias is fp32 (under `placement="jaxdp"` the router too).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxdp.config import ModelConfig
    from jaxdp.layout import Layout

EXPERT_DTYPES = ("bf16", "fp8", "nvfp4")
PLACEMENTS = ("sglang", "jaxdp")
KV_DTYPES = ("bf16", "fp8")
BF16 = 2
INDEX_QUANT_BLOCK = 128  # the DSA indexer key cache: fp8 keys, one fp32 scale per 128 values


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    params: int  # in the whole model
    bytes_total: float  # stored once, whole model
    bytes_per_device: float
    placement: str
    read_per_step: bool = True  # whether a decode step reads all of it (experts: only routed ones)


def matrix_bytes(rows: int, cols: int, dtype: str) -> float:
    """Bytes of one (rows x cols) weight matrix in a checkpoint dtype, scales included."""
    n = rows * cols
    if dtype == "bf16":
        return 2.0 * n
    if dtype == "fp8":
        return n + math.ceil(rows / 128) * math.ceil(cols / 128) * 4.0
    if dtype == "nvfp4":
        return n / 2 + n / 16 + 2 * 4.0
    raise ValueError(f"unknown weight dtype {dtype!r}; use one of {', '.join(EXPERT_DTYPES)}")


def linear_dtype(expert_dtype: str) -> str:
    """The dtype of the layers' other Linear weights (attention, shared expert, dense FFN) in a checkpoint
    whose routed experts are `expert_dtype`: a block-FP8 checkpoint stores them all FP8, NVFP4 only the experts."""
    return "fp8" if expert_dtype == "fp8" else "bf16"


def _attention_matrices(cfg: ModelConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]], tuple[int, int]]:
    """(replicated, split, kv_b) (in, out) matrices of one layer's attention projections."""
    h, nh = cfg.hidden_size, cfg.num_heads
    kv_a = (h, cfg.kv_cache_dim)
    kv_b = (cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
    o = (nh * cfg.v_head_dim, h)
    if cfg.q_lora_rank:
        return [(h, cfg.q_lora_rank), kv_a], [(cfg.q_lora_rank, nh * cfg.qk_head_dim), kv_b, o], kv_b
    return [kv_a], [(h, nh * cfg.qk_head_dim), kv_b, o], kv_b


def indexer_params(cfg: ModelConfig) -> int:
    """One layer's DSA indexer: wq_b (q_lora -> heads*dim), wk (hidden -> dim), weights_proj, k_norm."""
    if not cfg.index_n_heads:
        return 0
    q_in = cfg.q_lora_rank or cfg.hidden_size
    d, nh = cfg.index_head_dim, cfg.index_n_heads
    return q_in * nh * d + cfg.hidden_size * d + cfg.hidden_size * nh + 2 * d


def weights_per_device(cfg: ModelConfig, layout: Layout, expert_dtype: str = "bf16",
                       absorbed_copy: bool | None = None, placement: str = "sglang",
                       include_mtp: bool = False, num_redundant_experts: int = 0) -> list[Component]:
    """The weights one device of one model copy holds, component by component; `include_mtp` adds the
    model's MTP layer (speculative decoding's draft model, `mtp_component`, held without redundant experts);
    `num_redundant_experts` R (moe=ep, `--ep-num-redundant-experts`): R more expert slots per MoE layer, R / N a
    device, and under jaxdp's placement the logical-to-physical map every device holds (`jaxdp.eplb.slots`)."""
    if include_mtp and cfg.num_nextn_predict_layers:
        return [*weights_per_device(cfg, layout, expert_dtype, absorbed_copy, placement,
                                    num_redundant_experts=num_redundant_experts),
                mtp_component(cfg, layout, expert_dtype, absorbed_copy, placement)]
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert dtype {expert_dtype!r} is unknown; use one of {', '.join(EXPERT_DTYPES)}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement {placement!r} is unknown; use one of {', '.join(PLACEMENTS)}")
    sglang = placement == "sglang"
    absorbed_copy = sglang if absorbed_copy is None else absorbed_copy
    n, tp, dp = layout.world, layout.tp, layout.dp
    L, Lm, Ld, h = cfg.num_layers, cfg.num_moe_layers, cfg.num_dense_layers, cfg.hidden_size
    out: list[Component] = []

    def add(name: str, params: int, nbytes: float, share: float, placement: str, read: bool = True) -> None:
        if params:
            out.append(Component(name, params, nbytes, nbytes * share, placement, read))

    lin = linear_dtype(expert_dtype)
    tag = " (fp8)" if lin == "fp8" else ""
    rep_m, split_m, (kv_b_in, kv_b_out) = _attention_matrices(cfg)
    rep, split = (sum(matrix_bytes(i, o, lin) for i, o in m) for m in (rep_m, split_m))
    attn_params = sum(i * o for i, o in rep_m + split_m)
    kv_b = kv_b_in * kv_b_out
    group = "whole on every device" if tp == 1 else f"split over the group's tp={tp}"
    add("attention projections", attn_params * L, (rep + split) * L, (rep + split / tp) / (rep + split),
        ("all whole on every device" if tp == 1 else f"q_a, kv_a whole on every device; q_b, kv_b, o {group}")
        + tag)
    if absorbed_copy:
        add("absorbed copies (w_kc, w_vc)", kv_b * L, BF16 * kv_b * L, 1 / tp,
            f"second copy of kv_b for decoding, {group}", read=False)
    add("DSA indexer", indexer_params(cfg) * L, BF16 * indexer_params(cfg) * L, 1.0, "whole on every device")

    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    expert_bytes = 3 * matrix_bytes(inter, h, expert_dtype)
    if layout.moe == "ep":
        add("routed experts", 3 * h * inter * e * Lm, expert_bytes * e * Lm, math.ceil(e / n) / e,
            f"{math.ceil(e / n)} whole experts of {e} per device ({expert_dtype})", read=False)
    else:
        add("routed experts", 3 * h * inter * e * Lm, expert_bytes * e * Lm, 1 / n,
            f"1/{n} of every expert per device ({expert_dtype})", read=False)
    r = num_redundant_experts
    if r and layout.moe != "ep":
        raise ValueError(f"{r} redundant experts need moe=ep, not moe={layout.moe}")
    if r and Lm:
        add("redundant experts", 3 * h * inter * r * Lm, expert_bytes * r * Lm, 1 / n,
            f"{r // n} more whole experts per device, {(e + r) // n} slots of {e + r} ({expert_dtype})", read=False)
        if not sglang:  # the map [L, E, R + 1] and the replica counts [L, E], int32
            add("expert map", e * (r + 2) * Lm, 4 * e * (r + 2) * Lm, 1.0, "whole on every device (int32)")
    shared = 3 * h * inter * cfg.n_shared_experts * Lm
    add("shared expert", shared, 3 * matrix_bytes(inter * cfg.n_shared_experts, h, lin) * Lm,
        1.0 if layout.moe == "ep" else 1 / n,
        ("whole on every device" if layout.moe == "ep" else f"split over {n} devices") + tag)
    router = (BF16 if sglang else 4) * h + 4  # jaxdp runs the router in float32 (bias in float32 in both)
    add("router", e * h * Lm, router * e * Lm, 1.0, "whole on every device")
    dense = 3 * h * cfg.intermediate_size * Ld
    dense_n = 1 if layout.dense_replicated else (n if dp > 1 else tp)
    add("dense layers", dense, 3 * matrix_bytes(cfg.intermediate_size, h, lin) * Ld, 1 / dense_n,
        ("whole on every device" if dense_n == 1 else f"split over {dense_n} devices") + tag)
    vocab = cfg.vocab_size * h
    emb_n = 1 if (dp > 1 or not sglang) else tp
    add("embedding", vocab, BF16 * vocab, 1 / emb_n,
        f"vocab-split over {emb_n} devices" if emb_n > 1 else
        "whole on every device" + (" (attention DP)" if sglang else ""))
    if not cfg.tie_word_embeddings:
        head_n = (tp if sglang else 1) if layout.dp_lm_head else n
        add("LM head", vocab, BF16 * vocab, 1 / head_n,
            "whole on every device" if head_n == 1 else f"vocab-split over {head_n} devices")
    norms = L * (2 * h + (cfg.q_lora_rank or 0) + cfg.kv_lora_rank) + h
    add("norms", norms, BF16 * norms, 1.0, "whole on every device")
    return out


def mtp_component(cfg: ModelConfig, layout: Layout, expert_dtype: str = "bf16", absorbed_copy: bool | None = None,
                  placement: str = "sglang") -> Component:
    """The first MTP layer (`jaxdp.model.mtp`): one MoE decoder layer placed like the model's (with its DSA
    indexer), plus enorm, hnorm, shared_head.norm and eh_proj (bf16 [2h, h], whole on every device); the
    embedding and the head are the main model's. NVFP4 exports leave the MTP layer unquantized (SGLang drops
    the quantization of DeepSeek's NextN layer for them), so its experts count bf16 there."""
    h = cfg.hidden_size
    one = cfg.with_(num_layers=1, first_k_dense_replace=0, tie_word_embeddings=True, num_nextn_predict_layers=0)
    layer = [c for c in weights_per_device(one, layout, "bf16" if expert_dtype == "nvfp4" else expert_dtype,
                                           absorbed_copy, placement) if c.name != "embedding"]
    extra = 2 * h * h + 2 * h  # eh_proj; enorm and hnorm (the layer's "norms" count one more: shared_head.norm)
    params = sum(c.params for c in layer if not c.name.startswith("absorbed")) + extra + cfg.n_routed_experts
    return Component("MTP layer (NextN)", params, sum(c.bytes_total for c in layer) + BF16 * extra,
                     sum(c.bytes_per_device for c in layer) + BF16 * extra,
                     "one MoE layer placed as the model's; eh_proj and norms whole on every device",
                     read_per_step=False)


def total_bytes(components: list[Component], per_device: bool = True) -> float:
    return sum(c.bytes_per_device if per_device else c.bytes_total for c in components)


@dataclasses.dataclass(frozen=True)
class KVBytes:
    latent: int  # per token per layer: (kv_lora_rank + qk_rope_head_dim) x kv dtype
    indexer: int  # per token per layer: DSA index key (bf16; or fp8 + its fp32 scale)
    layers: int

    @property
    def per_token(self) -> int:
        return (self.latent + self.indexer) * self.layers


def kv_bytes(cfg: ModelConfig, kv_dtype: str = "bf16", include_mtp: bool = False) -> KVBytes:
    """Bytes one token occupies in one rank's cache (MLA: one latent for all heads; with tp > 1 every
    device of the group holds the whole entry). `include_mtp`: plus the MTP layer's draft KV, one more layer
    of the same entries (`jaxdp.model.mtp.empty_draft_cache`)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype {kv_dtype!r} is unknown; use one of {', '.join(KV_DTYPES)}")
    latent = cfg.kv_cache_dim * (2 if kv_dtype == "bf16" else 1)
    indexer = 0
    if cfg.index_n_heads and kv_dtype == "bf16":  # jaxdp's pool: the index key in the cache dtype
        indexer = cfg.index_head_dim * 2
    elif cfg.index_n_heads:  # fp8 keys with one fp32 scale per 128 values (SGLang's 132 bytes)
        indexer = cfg.index_head_dim + cfg.index_head_dim // INDEX_QUANT_BLOCK * 4
    return KVBytes(latent, indexer, cfg.num_layers + (1 if include_mtp and cfg.num_nextn_predict_layers else 0))


def handoff(per_token: int, prompts: tuple[int, ...], link_gbs: float) -> list[dict[str, float]]:
    """Prefill/decode disaggregation: the KV a prompt hands from the prefill server to the decode server (every
    layer's entries of each of its tokens, `jaxdp.disagg.kv`) and the time it takes at `link_gbs` GB/s between the
    two ranks, for each prompt length."""
    return [{"tokens": t, "bytes": t * per_token, "ms": t * per_token / (link_gbs * 1e9) * 1e3} for t in prompts]


def kv_tokens(budget_bytes: float, weight_bytes: float, per_token: int) -> int:
    """Tokens of KV cache one device holds when `budget_bytes` (mem_fraction_static x memory) must hold
    the weights and the cache; negative when the weights alone do not fit."""
    return math.floor((budget_bytes - weight_bytes) / per_token)
