"""ModelConfig: the DeepSeek-V3 architecture's numbers, read from a Hugging Face config.json or a preset.

Every field that changes the math is read here; a field whose value jaxdp does not implement is
refused by name (`UnsupportedConfigError`), so a checkpoint never runs with silently different math.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


class UnsupportedConfigError(ValueError):
    """A config.json asks for something jaxdp does not implement; the message says what."""


SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "glm_moe_dsa", "deepseek_v32")
DSA_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")  # DeepSeek sparse attention: MLA plus the indexer


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str = "deepseek_v3"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128  # dense (first_k_dense_replace) layers
    moe_intermediate_size: int = 32
    num_layers: int = 3
    num_heads: int = 8
    q_lora_rank: int | None = 32  # None: a plain q_proj
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope scaling, normalised: None or {"rope_type": "yarn", "factor":..., ...}
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # DeepSeek sparse attention (GLM-5, DeepSeek-V3.2; see jaxdp.model.indexer): the indexer picks
    # index_topk earlier tokens per query; None: dense MLA. index_rope_interleave: the indexer's rope
    # layout (interleaved pairs for GLM-5, half-split for V3.2). indexer_types: per layer "full" (runs
    # its indexer) or "shared" (reuses the previous full layer's selection); None: all full.
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = True
    indexer_types: tuple[str, ...] | None = None
    # FP8 block quantization of the checkpoint (dequantized on load): block size (rows, cols) or None
    fp8_block: tuple[int, int] | None = None
    # multi-token-prediction (NextN) layers the checkpoint declares, stored as layers num_layers.. (see
    # jaxdp.model.mtp); the main model never reads them
    num_nextn_predict_layers: int = 0

    # ---- derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token per layer: the normalised latent plus the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim**-0.5, times mscale**2 under YaRN with mscale_all_dim (DeepSeek's convention)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs and rs.get("rope_type") == "yarn":
            mscale_all_dim = rs.get("mscale_all_dim", 0) or 0
            if mscale_all_dim:
                m = yarn_get_mscale(rs["factor"], mscale_all_dim)
                scale *= m * m
        return scale

    def with_(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    @property
    def index_key_dim(self) -> int:
        """Width of one cached DSA index key per token per layer (0 without sparse attention)."""
        return self.index_head_dim if self.index_topk else 0

    @property
    def indexer_full(self) -> tuple[bool, ...]:
        """Per layer: does it run its own indexer (False: it reuses the previous full layer's top-k)."""
        if not self.indexer_types:
            return (True,) * self.num_layers
        return tuple(t == "full" for t in self.indexer_types)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# ---- reading config.json ---------------------------------------------------------------------

_ROPE_TYPES = ("default", "yarn", "linear")


def _normalise_rope(raw: dict[str, Any], rope_theta: float) -> tuple[float, dict[str, Any] | None]:
    """Accept `rope_scaling` (published checkpoints) or `rope_parameters` (transformers 5)."""
    rs = raw.get("rope_scaling") or None
    rp = raw.get("rope_parameters") or None
    if rp and "rope_theta" in rp:
        rope_theta = float(rp["rope_theta"])
    scaling = rs or rp
    if not scaling:
        return rope_theta, None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type not in _ROPE_TYPES:
        raise UnsupportedConfigError(
            f"rope type {rope_type!r} is not supported; jaxdp implements {', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return rope_theta, None
    scaling["rope_type"] = rope_type
    return rope_theta, scaling


def _refuse(raw: dict[str, Any], key: str, allowed: tuple[Any, ...], default: Any) -> None:
    value = raw.get(key, default)
    if value not in allowed:
        raise UnsupportedConfigError(
            f"config.json sets {key}={value!r}, which jaxdp does not implement "
            f"(supported: {', '.join(repr(a) for a in allowed)})"
        )


def config_from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type", "deepseek_v3")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"model_type {model_type!r} is not supported; jaxdp serves {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "kimi_k2" and "text_config" in raw:  # multimodal wrappers keep the LM inside
        raw = {**raw["text_config"], "model_type": "kimi_k2"}
    _refuse(raw, "hidden_act", ("silu",), "silu")
    _refuse(raw, "scoring_func", ("sigmoid",), "sigmoid")
    _refuse(raw, "topk_method", ("noaux_tc",), "noaux_tc")
    _refuse(raw, "attention_bias", (False,), False)
    _refuse(raw, "moe_layer_freq", (1,), 1)
    num_kv = raw.get("num_key_value_heads", raw.get("num_attention_heads"))
    if num_kv != raw.get("num_attention_heads"):
        # MLA checkpoints set num_key_value_heads == num_attention_heads; anything else is not MLA
        raise UnsupportedConfigError(
            f"config.json sets num_key_value_heads={num_kv} != num_attention_heads="
            f"{raw.get('num_attention_heads')}; jaxdp's MLA expects them equal"
        )
    fp8_block = None
    qc = raw.get("quantization_config")
    if qc:
        method = qc.get("quant_method")
        if method == "fp8" and qc.get("weight_block_size"):
            fp8_block = tuple(int(b) for b in qc["weight_block_size"])
        else:
            raise UnsupportedConfigError(
                f"quantization_config.quant_method={method!r} is not supported; jaxdp loads bf16/fp32 "
                "checkpoints and DeepSeek's block-FP8 ones"
            )
    rope_theta, rope_scaling = _normalise_rope(raw, float(raw.get("rope_theta", 10000.0)))
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(eos)
    dsa = _dsa_fields(raw, model_type)
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        n_routed_experts=raw["n_routed_experts"],
        n_shared_experts=raw.get("n_shared_experts") or 0,
        num_experts_per_tok=raw["num_experts_per_tok"],
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        first_k_dense_replace=raw.get("first_k_dense_replace", 0),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rope_interleave=True if dsa else bool(raw.get("rope_interleave", True)),  # DSA's MLA: always pairs
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
        **dsa,
        fp8_block=fp8_block,
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


def _indexer_types(raw: dict[str, Any]) -> tuple[str, ...] | None:
    """GLM-5's per-layer indexer modes, as transformers' GlmMoeDsaConfig derives them: `indexer_types`,
    else `index_topk_pattern` ("FSS..."), else every `index_topk_freq`-th layer past
    `index_skip_topk_offset` (default 2) runs its indexer. None: every layer runs its own."""
    n = raw["num_hidden_layers"]
    types = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if types is None and pattern is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq, offset = max(int(raw.get("index_topk_freq", 1)), 1), int(raw.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = tuple(types)
    if len(types) != n or set(types) - {"full", "shared"} or types[0] != "full":
        raise UnsupportedConfigError(
            f"config.json's indexer layer types {list(types)} are not {n} entries of 'full'/'shared' starting "
            "with 'full'; fix indexer_types (or index_topk_pattern / index_topk_freq)")
    return None if all(t == "full" for t in types) else types


def _dsa_fields(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The DeepSeek-sparse-attention fields of a glm_moe_dsa / deepseek_v32 config.json ({} otherwise)."""
    if model_type not in DSA_MODEL_TYPES:
        return {}
    defaults = {"glm_moe_dsa": 32, "deepseek_v32": 64}  # index_n_heads, as transformers defaults them
    if raw.get("q_lora_rank") is None:
        raise UnsupportedConfigError(f"a {model_type} config.json needs q_lora_rank: the DSA indexer's query "
                                     "reads the q LoRA residual")
    return {
        "index_topk": int(raw.get("index_topk", 2048)),
        "index_n_heads": int(raw.get("index_n_heads", defaults[model_type])),
        "index_head_dim": int(raw.get("index_head_dim", 128)),
        "index_rope_interleave": model_type == "glm_moe_dsa",
        "indexer_types": _indexer_types(raw) if model_type == "glm_moe_dsa" else None,
    }


def load_hf_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json; pass a Hugging Face checkpoint directory")
    return config_from_hf_dict(json.loads(path.read_text()))


# ---- presets -----------------------------------------------------------------------------------

_YARN_DEEPSEEK = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

_DEEPSEEK_V3 = ModelConfig(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_layers=61,
    num_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=3,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=_YARN_DEEPSEEK,
    max_position_embeddings=163840,
    bos_token_id=0,
    eos_token_id=1,
    num_nextn_predict_layers=1,
)

PRESETS: dict[str, ModelConfig] = {
    # The embedded default: compiles in seconds on a CPU, yet exercises every mechanism (8 routed
    # experts top-2, a shared expert, a dense first layer, q and kv LoRA).
    "tiny": ModelConfig(),
    "deepseek-v3": _DEEPSEEK_V3,
    # Kimi K2 (the sizes of moonshotai/Kimi-K2-Instruct): DeepSeek-V3's architecture with 384 routed experts, 64
    # heads, one dense layer and no group-limited routing; the planner's stand-in for the article's Kimi K3 row
    "kimi-k2": _DEEPSEEK_V3.with_(model_type="kimi_k2", vocab_size=163840, num_heads=64, n_routed_experts=384,
                                  n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
                                  rope_theta=50000.0, rope_scaling={**_YARN_DEEPSEEK, "factor": 32.0},
                                  max_position_embeddings=131072, bos_token_id=163584, eos_token_id=163585,
                                  num_nextn_predict_layers=0),
    # GLM-5 (and the article's GLM-5.3): MLA plus the DSA indexer (index_topk 2,048 of up to 202,752).
    "glm-5": ModelConfig(
        model_type="glm_moe_dsa",
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_layers=78,
        num_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=3,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        rope_scaling=None,
        max_position_embeddings=202752,
        index_topk=2048,
        index_n_heads=32,
        index_head_dim=128,
        num_nextn_predict_layers=1,
    ),
}
# GLM-5 at CPU size (the sparse-attention benchmark): 16 heads reading a 256 + 32 latent, an indexer of
# 8 heads x 64 (1/17 of attention's work per context token, as in GLM-5), index_topk 2,048
# and every other layer shared, as GLM-5's IndexCache variant runs it.
PRESETS["glm-5-tiny"] = PRESETS["tiny"].with_(
    model_type="glm_moe_dsa", num_layers=4, num_heads=16, kv_lora_rank=256, qk_nope_head_dim=32,
    qk_rope_head_dim=32, v_head_dim=32, max_position_embeddings=202752, index_topk=2048, index_n_heads=8,
    index_head_dim=64, indexer_types=("full", "shared", "full", "shared"))


def get_config(name_or_path: str) -> ModelConfig:
    """A preset name (tiny, deepseek-v3, glm-5, glm-5-tiny) or a checkpoint directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if Path(name_or_path).is_dir():
        return load_hf_config(name_or_path)
    raise FileNotFoundError(
        f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a config.json"
    )


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The Hugging Face config.json of `cfg` (DeepSeek-V3 names), the inverse of `load_hf_config`."""
    d = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "n_group": cfg.n_group,
        "topk_group": cfg.topk_group, "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob, "first_k_dense_replace": cfg.first_k_dense_replace,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_interleave": cfg.rope_interleave, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers, "torch_dtype": "float32",
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    return d
