"""Hugging Face checkpoints <-> the stacked parameters of `DeepseekV3`.

Reads safetensors (one file or a sharded index), maps the per-layer names onto the dense and MoE
stacks, transposes torch's [out, in] Linear weights once, dequantizes DeepSeek's block-FP8 weights
(`weight_scale_inv`, one scale per 128x128 block) and casts to the requested dtype. Experts are read
in either spelling: one tensor per expert (`experts.{j}.gate_proj.weight`, as published checkpoints
and transformers' save_pretrained write them) or fused (`experts.gate_up_proj`, transformers' in-memory
layout). Multi-token-prediction layers past num_hidden_layers are skipped. `save_hf_checkpoint` writes
the inverse, so a model trained here is served from the same format.

NVFP4: `quantization="nvfp4"` quantizes the routed experts layer by layer as they are read (from
float32); a ModelOpt NVFP4 checkpoint (`jaxdp.model.modelopt`) keeps its experts as stored; a directory
written by `python -m jaxdp.quantize` (orbax) is detected and restored.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file
from tqdm import tqdm

from jaxdp.config import ModelConfig, load_hf_config
from jaxdp.model import modelopt
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.indexer import hf_indexer_weights
from jaxdp.model.moe import NVFP4_PARAMS, nvfp4_expert_params
from jaxdp.model.quant import check_quantization, expert_quantization, quantize_experts

log = logging.getLogger("jaxdp.loader")

Getter = Callable[[str], np.ndarray]
# safetensors' numpy reader has no float8; these are read from the file's bytes
_F8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint directory, by name, as float32 numpy arrays."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig):
        self.dir = Path(model_dir)
        self.cfg = cfg
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{model_dir} holds no .safetensors files")
            weight_map = {}
            for f in files:
                with safe_open(f, "np") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}
        self._headers: dict[str, tuple[dict, int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _raw(self, name: str) -> np.ndarray:
        if name not in self.weight_map:
            raise KeyError(f"the checkpoint in {self.dir} has no tensor {name!r}")
        fname = self.weight_map[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.dir / fname, "np")
        dtype = self._handles[fname].get_slice(name).get_dtype()
        if dtype in _F8_DTYPES:
            return self._read_f8(fname, name, _F8_DTYPES[dtype])
        return self._handles[fname].get_tensor(name)

    def _read_f8(self, fname: str, name: str, dtype) -> np.ndarray:
        if fname not in self._headers:
            with open(self.dir / fname, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                self._headers[fname] = (json.loads(f.read(n)), 8 + n)
        header, start = self._headers[fname]
        begin, end = header[name]["data_offsets"]
        data = np.fromfile(self.dir / fname, dtype=np.uint8, count=end - begin, offset=start + begin)
        return data.view(dtype).reshape(header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        w = self._raw(name)
        scale_name = name.replace(".weight", ".weight_scale_inv")
        nvfp4_base = name.removesuffix(".weight")
        if name.endswith(".weight") and scale_name in self.weight_map:
            w = dequantize_fp8_blocks(w, self._raw(scale_name), self.cfg.fp8_block or (128, 128))
        elif name.endswith(".weight") and f"{nvfp4_base}.weight_scale_2" in self.weight_map:
            w = modelopt.dequantize_weight(w, self._raw(f"{nvfp4_base}.weight_scale"),
                                           self._raw(f"{nvfp4_base}.weight_scale_2"))
        return np.asarray(w, dtype=np.float32)


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """DeepSeek's block FP8: w_fp8 * scale_inv[i // bm, j // bn]."""
    bm, bn = block
    w32 = np.asarray(w.astype(np.float32) if w.dtype != np.uint8 else w.view(jnp.float8_e4m3fn), np.float32)
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)
    return w32 * s[: w32.shape[0], : w32.shape[1]]


# ---- the name map ------------------------------------------------------------------------------


def _attn_params(cfg: ModelConfig) -> dict[str, Callable[[Getter, str], np.ndarray]]:
    H, K = cfg.num_heads, cfg.qk_head_dim
    p: dict[str, Callable[[Getter, str], np.ndarray]] = {
        "attn_norm": lambda g, pre: g(f"{pre}.input_layernorm.weight"),
        "ffn_norm": lambda g, pre: g(f"{pre}.post_attention_layernorm.weight"),
        "attn.w_kv_a_DK": lambda g, pre: g(f"{pre}.self_attn.kv_a_proj_with_mqa.weight").T,
        "attn.kv_a_norm": lambda g, pre: g(f"{pre}.self_attn.kv_a_layernorm.weight"),
        "attn.w_kv_b_LHX": lambda g, pre: g(f"{pre}.self_attn.kv_b_proj.weight").T.reshape(
            cfg.kv_lora_rank, H, cfg.qk_nope_head_dim + cfg.v_head_dim),
        "attn.w_o_HVD": lambda g, pre: g(f"{pre}.self_attn.o_proj.weight").T.reshape(
            H, cfg.v_head_dim, cfg.hidden_size),
    }
    if cfg.q_lora_rank is not None:
        p["attn.w_q_a_DQ"] = lambda g, pre: g(f"{pre}.self_attn.q_a_proj.weight").T
        p["attn.q_a_norm"] = lambda g, pre: g(f"{pre}.self_attn.q_a_layernorm.weight")
        p["attn.w_q_b_QHK"] = lambda g, pre: g(f"{pre}.self_attn.q_b_proj.weight").T.reshape(
            cfg.q_lora_rank, H, K)
    else:
        p["attn.w_q_DHK"] = lambda g, pre: g(f"{pre}.self_attn.q_proj.weight").T.reshape(
            cfg.hidden_size, H, K)
    return p


def _mlp(g: Getter, pre: str) -> tuple[np.ndarray, np.ndarray]:
    gate_up = np.stack([g(f"{pre}.gate_proj.weight").T, g(f"{pre}.up_proj.weight").T], axis=1)
    return gate_up, g(f"{pre}.down_proj.weight").T


def _experts(reader: CheckpointReader, g: Getter, pre: str, cfg: ModelConfig):
    fused = f"{pre}.mlp.experts.gate_up_proj"
    if fused in reader:  # [E, 2I, D] and [E, D, I]
        gu = g(fused)
        I = cfg.moe_intermediate_size
        gate_up = np.stack([gu[:, :I].transpose(0, 2, 1), gu[:, I:].transpose(0, 2, 1)], axis=2)
        return gate_up, g(f"{pre}.mlp.experts.down_proj").transpose(0, 2, 1)
    pairs = [_mlp(g, f"{pre}.mlp.experts.{j}") for j in range(cfg.n_routed_experts)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def load_checkpoint(model_dir: str | Path, dtype=jnp.bfloat16, cfg: ModelConfig | None = None,
                    quantization: str | None = None):
    """(ModelConfig, DeepseekV3 with the checkpoint's weights in `dtype`; routed experts in NVFP4 when
    `quantization="nvfp4"` or the checkpoint is a ModelOpt NVFP4 one)."""
    mo_config = modelopt.read_quant_config(model_dir)
    cfg = cfg or (modelopt.load_config(model_dir) if mo_config else load_hf_config(model_dir))
    reader = CheckpointReader(model_dir, cfg)
    g = reader.get
    stored_nvfp4 = mo_config is not None and modelopt.experts_are_nvfp4(reader.__contains__, cfg)
    quantization = "nvfp4" if stored_nvfp4 else check_quantization(quantization)
    model = nnx.eval_shape(lambda: quantize_experts(DeepseekV3(cfg, nnx.Rngs(0), dtype), quantization))
    input_scales: list[np.ndarray] = []
    values: dict[str, np.ndarray] = {"embed_VD": g("model.embed_tokens.weight"),
                                     "final_norm": g("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        values["lm_head_DV"] = g("lm_head.weight").T
    stacks = (("dense_layers", range(cfg.num_dense_layers)),
              ("moe_layers", range(cfg.num_dense_layers, cfg.num_layers)))
    attn = _attn_params(cfg)
    with tqdm(total=cfg.num_layers, desc="Loading layers", unit="layer", disable=cfg.num_layers < 8) as bar:
        for stack, layer_ids in stacks:
            per_layer: dict[str, list[np.ndarray]] = {}
            for i in layer_ids:
                pre = f"model.layers.{i}"
                for key, fn in attn.items():
                    per_layer.setdefault(key, []).append(fn(g, pre))
                for key, arr in hf_indexer_weights(cfg, g, i).items():  # DSA models' indexer
                    per_layer.setdefault(key, []).append(arr)
                if stack == "dense_layers":
                    gu, d = _mlp(g, f"{pre}.mlp")
                    items = {"ffn.w_gate_up_D2F": gu, "ffn.w_down_FD": d}
                else:
                    items = {"ffn.router_DE": g(f"{pre}.mlp.gate.weight").T,
                             "ffn.router_bias_E": g(f"{pre}.mlp.gate.e_score_correction_bias")}
                    if stored_nvfp4:
                        experts, scales = modelopt.read_nvfp4_experts(reader._raw, reader.__contains__, pre, cfg)
                        input_scales.append(scales)
                    elif quantization == "nvfp4":  # quantize from float32, one layer at a time
                        experts = jax.tree.map(np.asarray, nvfp4_expert_params(*_experts(reader, g, pre, cfg)))
                    else:
                        gu, d = _experts(reader, g, pre, cfg)
                        experts = {"w_gate_up_ED2I": gu, "w_down_EID": d}
                    items |= {f"ffn.{k}": v for k, v in experts.items()}
                    if cfg.n_shared_experts:
                        sgu, sd = _mlp(g, f"{pre}.mlp.shared_experts")
                        items |= {"ffn.shared.w_gate_up_D2F": sgu, "ffn.shared.w_down_FD": sd}
                for key, arr in items.items():
                    per_layer.setdefault(key, []).append(arr)
                bar.update()
            for key, arrs in per_layer.items():
                values[f"{stack}.{key}"] = np.stack(arrs)
    _assign(model, values, dtype)
    if stored_nvfp4:
        log.info(modelopt.describe_input_scales(input_scales))
    return cfg, model


def _assign(model: DeepseekV3, values: dict[str, np.ndarray], dtype) -> None:
    for path, arr in values.items():
        *parents, leaf = path.split(".")
        obj = model
        for p in parents:
            obj = getattr(obj, p)
        param = getattr(obj, leaf)
        keep_f32 = leaf.startswith("router")  # the router runs in float32, as DeepSeek's does
        want = param.get_value().shape
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"checkpoint tensor for {path} has shape {arr.shape}, expected {want}")
        # NVFP4 experts keep their own dtypes (uint8 codes, E4M3 scales, float32 global scales)
        target = param.get_value().dtype if leaf in NVFP4_PARAMS else jnp.float32 if keep_f32 else dtype
        param.set_value(jnp.asarray(arr, target))


# ---- saving ------------------------------------------------------------------------------------


def hf_state_dict(model: DeepseekV3) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face DeepSeek-V3 names, torch layout, float32."""
    cfg = model.cfg
    if expert_quantization(model):
        raise ValueError("a model with NVFP4 experts is not written as a Hugging Face checkpoint; save it with "
                         "python -m jaxdp.quantize (orbax)")

    def a(x) -> np.ndarray:
        return np.asarray(jax.device_get(x[...]), np.float32)

    out = {"model.embed_tokens.weight": a(model.embed_VD), "model.norm.weight": a(model.final_norm)}
    if model.lm_head_DV is not None:
        out["lm_head.weight"] = a(model.lm_head_DV).T
    for stack, first in ((model.dense_layers, 0), (model.moe_layers, cfg.num_dense_layers)):
        if stack is None:
            continue
        n = stack.attn_norm.get_value().shape[0]
        for j in range(n):
            pre = f"model.layers.{first + j}"
            at = stack.attn
            out[f"{pre}.input_layernorm.weight"] = a(stack.attn_norm)[j]
            out[f"{pre}.post_attention_layernorm.weight"] = a(stack.ffn_norm)[j]
            out[f"{pre}.self_attn.kv_a_proj_with_mqa.weight"] = a(at.w_kv_a_DK)[j].T
            out[f"{pre}.self_attn.kv_a_layernorm.weight"] = a(at.kv_a_norm)[j]
            kvb = a(at.w_kv_b_LHX)[j]
            out[f"{pre}.self_attn.kv_b_proj.weight"] = kvb.reshape(kvb.shape[0], -1).T
            o = a(at.w_o_HVD)[j]
            out[f"{pre}.self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
            if cfg.q_lora_rank is not None:
                out[f"{pre}.self_attn.q_a_proj.weight"] = a(at.w_q_a_DQ)[j].T
                out[f"{pre}.self_attn.q_a_layernorm.weight"] = a(at.q_a_norm)[j]
                qb = a(at.w_q_b_QHK)[j]
                out[f"{pre}.self_attn.q_b_proj.weight"] = qb.reshape(qb.shape[0], -1).T
            else:
                q = a(at.w_q_DHK)[j]
                out[f"{pre}.self_attn.q_proj.weight"] = q.reshape(q.shape[0], -1).T
            ffn = stack.ffn
            if first == 0:
                _put_mlp(out, f"{pre}.mlp", a(ffn.w_gate_up_D2F)[j], a(ffn.w_down_FD)[j])
                continue
            out[f"{pre}.mlp.gate.weight"] = a(ffn.router_DE)[j].T
            out[f"{pre}.mlp.gate.e_score_correction_bias"] = a(ffn.router_bias_E)[j]
            gu, dn = a(ffn.w_gate_up_ED2I)[j], a(ffn.w_down_EID)[j]
            for e in range(gu.shape[0]):
                _put_mlp(out, f"{pre}.mlp.experts.{e}", gu[e], dn[e])
            if ffn.shared is not None:
                _put_mlp(out, f"{pre}.mlp.shared_experts", a(ffn.shared.w_gate_up_D2F)[j],
                         a(ffn.shared.w_down_FD)[j])
    # contiguous: safetensors writes an array's buffer as it lies in memory
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _put_mlp(out: dict, pre: str, gate_up_D2F: np.ndarray, down_FD: np.ndarray) -> None:
    out[f"{pre}.gate_proj.weight"] = np.ascontiguousarray(gate_up_D2F[:, 0].T)
    out[f"{pre}.up_proj.weight"] = np.ascontiguousarray(gate_up_D2F[:, 1].T)
    out[f"{pre}.down_proj.weight"] = np.ascontiguousarray(down_FD.T)


def hf_config_dict(cfg: ModelConfig) -> dict:
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
        "num_nextn_predict_layers": 0, "torch_dtype": "float32",
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    return d


def save_hf_checkpoint(model: DeepseekV3, out_dir: str | Path, dtype=np.float32) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in hf_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.cfg), indent=2) + "\n")
    log.info("saved %d tensors to %s", len(tensors), out)


def load_model(path: str, dtype="bfloat16", *, seed: int = 0, num_layers: int | None = None,
               tiny_width: bool = False, quantization: str | None = None):
    """A checkpoint directory (Hugging Face, ModelOpt NVFP4, or `jaxdp.quantize`'s orbax output), or a
    preset name with random weights (seeded); `quantization="nvfp4"` holds the routed experts as NVFP4.

    `num_layers` overrides a preset's depth; `tiny_width` keeps a preset's depth and dense/MoE split
    but the tiny model's widths (to measure how compile time grows with depth).
    """
    from jaxdp.config import PRESETS, get_config

    if path is None or path == "default":  # the embedded default model (jaxdp/assets/default-model)
        path = str(default_model_path())
    dt = jnp.dtype(dtype)
    if path not in PRESETS:
        from jaxdp.quantize import is_converted, load_converted

        if is_converted(path):
            cfg, model = load_converted(path, dt)
            return cfg, quantize_experts(model, quantization)
        return load_checkpoint(path, dt, quantization=quantization)
    cfg = get_config(path)
    if tiny_width:
        tiny = PRESETS["tiny"]
        cfg = tiny.with_(num_layers=cfg.num_layers, first_k_dense_replace=cfg.first_k_dense_replace)
    if num_layers is not None:
        dense = min(cfg.first_k_dense_replace, num_layers)
        cfg = cfg.with_(num_layers=num_layers, first_k_dense_replace=dense)
    return cfg, quantize_experts(DeepseekV3(cfg, nnx.Rngs(seed), dt), quantization)


def default_model_path() -> Path:
    """The embedded default model shipped with jaxdp (trained by `python -m jaxdp.train`)."""
    return Path(__file__).resolve().parent.parent / "assets" / "default-model"
