"""Hugging Face checkpoints <-> `DeepseekV3`, and the one way a model is built for the step.

`build_model` is the construction path of every entry point (serve, Engine, one_batch): a checkpoint
directory is read straight into its final sharding (`jaxdp.model.sharded`: slices in the stored dtype,
block-FP8 kept FP8, ModelOpt NVFP4 experts kept NVFP4); a preset gets random weights created on the
devices in their sharding; a directory written by `python -m jaxdp.quantize` (orbax) is restored and
moved onto the mesh. `load_model` / `load_checkpoint` give a whole model on one device (tests, tools).
`save_hf_checkpoint` writes the inverse (FP8 weights dequantized), so a model trained here is served
from the same format.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxdp.config import PRESETS, ModelConfig, get_config, hf_config_dict, load_hf_config
from jaxdp.layout import Layout
from jaxdp.model import modelopt
from jaxdp.model.checkpoint import Checkpoint
from jaxdp.model.converted import MARKER, is_converted, load_converted
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.fp8 import dequantize_fp8_blocks, weight
from jaxdp.model.mtp import MTPLayer, mtp_prefix
from jaxdp.model.quant import expert_quantization, quantize_experts, with_fp8_gemm_backend
from jaxdp.model.sharded import (
    ShardedModel,
    check_mtp,
    init_mtp_sharded,
    init_sharded,
    load_mtp_sharded,
    load_sharded,
    shard_model,
)

log = logging.getLogger("jaxdp.loader")

__all__ = ["build_model", "load_model", "load_checkpoint", "save_hf_checkpoint", "hf_state_dict",
           "default_model_path", "dequantize_fp8_blocks", "build_mtp", "load_mtp", "check_mtp_checkpoint"]


def build_model(path: str | None, layout: Layout, mesh, dtype="bfloat16", *, seed: int = 0,
                quantization: str | None = None, num_layers: int | None = None,
                tiny_width: bool = False, fp8_gemm_backend: str | None = None) -> ShardedModel:
    """The model for `path` (a checkpoint directory, an orbax conversion, a preset name, or None /
    "default" for the embedded default model) with every array in its final sharding on `mesh`, its projection
    GEMM's backend `fp8_gemm_backend` (None: the platform's default; `jaxdp.model.quant.with_fp8_gemm_backend`)."""
    return with_gemm(_build_model(path, layout, mesh, dtype, seed, quantization, num_layers, tiny_width),
                     fp8_gemm_backend)


def with_gemm(model: ShardedModel, backend: str | None) -> ShardedModel:
    """A built model (or MTP layer) with its projection GEMM's backend set (None: as it is); arrays shared."""
    if backend is None:
        return model
    return ShardedModel(model.cfg, *nnx.split(with_fp8_gemm_backend(model.merge(), backend)))


def _build_model(path, layout, mesh, dtype, seed, quantization, num_layers, tiny_width) -> ShardedModel:
    if path is None or path == "default":
        path = str(default_model_path())
    dt = jnp.dtype(dtype)
    if path in PRESETS:
        return init_sharded(preset_config(path, num_layers, tiny_width), layout, mesh, dt, seed, quantization)
    if is_converted(path):
        _, model = load_converted(path, dt)
        return shard_model(quantize_experts(model, quantization), layout, mesh)
    return load_sharded(path, layout, mesh, dt, quantization)


def build_mtp(path: str | None, layout: Layout, mesh, dtype="bfloat16", *, seed: int = 0,
              quantization: str | None = None, num_layers: int | None = None, tiny_width: bool = False,
              k: int = 0, fp8_gemm_backend: str | None = None) -> ShardedModel:
    """The MTP layer k of the model `build_model` builds for the same arguments, in its final sharding:
    read from a checkpoint directory (refused in one sentence when it has none), random for a preset (seeded
    apart from the main model's weights), its projection GEMM's backend `fp8_gemm_backend` as `build_model`'s."""
    if path is None or path == "default":
        path = str(default_model_path())
    dt = jnp.dtype(dtype)
    if path in PRESETS:
        cfg = preset_config(path, num_layers, tiny_width)
        return with_gemm(init_mtp_sharded(cfg, layout, mesh, dt, seed + 1, quantization), fp8_gemm_backend)
    if is_converted(path):
        raise ValueError(f"{path} is an orbax conversion (python -m jaxdp.quantize), which holds no MTP layer; "
                         "point --model-path at the Hugging Face checkpoint to use its MTP layer")
    return with_gemm(load_mtp_sharded(path, layout, mesh, dt, quantization, k=k), fp8_gemm_backend)


def check_mtp_checkpoint(path: str, k: int = 0) -> None:
    """Refuse, in one sentence and reading only the tensor headers, a checkpoint directory whose MTP layer k
    is missing (what a speculative-decoding flag should check before anything loads). Presets pass."""
    if path in PRESETS:
        return
    with Checkpoint(path) as ck:
        check_mtp(ck, model_config(path), k)


def preset_config(name: str, num_layers: int | None = None, tiny_width: bool = False) -> ModelConfig:
    """A preset's config; `num_layers` overrides its depth; `tiny_width` keeps its depth and dense/MoE
    split at the tiny model's widths (to measure how compile time grows with depth)."""
    cfg = get_config(name)
    if tiny_width:
        cfg = PRESETS["tiny"].with_(num_layers=cfg.num_layers, first_k_dense_replace=cfg.first_k_dense_replace)
    if num_layers is not None:
        cfg = cfg.with_(num_layers=num_layers, first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers))
    return cfg


def model_config(path: str | None, num_layers: int | None = None, tiny_width: bool = False) -> ModelConfig:
    """The config `build_model` would build `path` with (quantization aside), read without the weights."""
    if path is None or path == "default":
        path = str(default_model_path())
    if path in PRESETS:
        return preset_config(path, num_layers, tiny_width)
    if is_converted(path):
        raw = json.loads((Path(path) / MARKER).read_text())["model_config"]
        return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    return modelopt.load_config(path) if modelopt.read_quant_config(path) else load_hf_config(path)


def load_checkpoint(model_dir: str | Path, dtype=jnp.bfloat16, cfg: ModelConfig | None = None,
                    quantization: str | None = None) -> tuple[ModelConfig, DeepseekV3]:
    """(ModelConfig, DeepseekV3 on one device): the checkpoint read as `load_sharded` reads it."""
    layout = Layout()
    sharded = load_sharded(model_dir, layout, layout.make_mesh(jax.devices()[:1]), dtype, quantization, cfg)
    return sharded.cfg, sharded.merge()


# ---- saving ------------------------------------------------------------------------------------


def hf_state_dict(model: DeepseekV3, mtp: MTPLayer | None = None) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face DeepSeek-V3 names, torch layout, float32; with `mtp`, its MTP
    layer as DeepSeek-V3 stores it (layer num_hidden_layers, with copies of the embedding and the LM head)."""
    cfg = model.cfg
    if expert_quantization(model) or (mtp is not None and expert_quantization(mtp)):
        raise ValueError("a model with NVFP4 experts is not written as a Hugging Face checkpoint; save it with "
                         "python -m jaxdp.quantize (orbax)")
    out = {"model.embed_tokens.weight": _a(model.embed_VD), "model.norm.weight": _a(model.final_norm)}
    if model.lm_head_DV is not None:
        out["lm_head.weight"] = _a(model.lm_head_DV).T
    for stack, first in ((model.dense_layers, 0), (model.moe_layers, cfg.num_dense_layers)):
        if stack is not None:
            for j in range(stack.attn_norm.get_value().shape[0]):
                _put_layer(out, stack, j, f"model.layers.{first + j}", dense=stack is model.dense_layers)
    if mtp is not None:
        pre = mtp_prefix(cfg)
        out[f"{pre}.enorm.weight"], out[f"{pre}.hnorm.weight"] = _a(mtp.enorm), _a(mtp.hnorm)
        out[f"{pre}.eh_proj.weight"] = _a(mtp.w_eh_XD).T
        out[f"{pre}.shared_head.norm.weight"] = _a(mtp.shared_head_norm)
        out[f"{pre}.embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[f"{pre}.shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"])
        dense = mtp.moe_layers is None
        _put_layer(out, mtp.dense_layers if dense else mtp.moe_layers, 0, pre, dense=dense)
    # contiguous: safetensors writes an array's buffer as it lies in memory
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _a(x) -> np.ndarray:
    return np.asarray(jax.device_get(x[...]), np.float32)


def _w(module, name: str) -> np.ndarray:  # FP8 weights come out dequantized
    return np.asarray(jax.device_get(weight(module, name)), np.float32)


def _put_layer(out: dict, stack, j: int, pre: str, dense: bool) -> None:
    """Layer j of a layer stack under the checkpoint prefix `pre` (model.layers.{i})."""
    a, w = _a, _w
    at = stack.attn
    out[f"{pre}.input_layernorm.weight"] = a(stack.attn_norm)[j]
    out[f"{pre}.post_attention_layernorm.weight"] = a(stack.ffn_norm)[j]
    out[f"{pre}.self_attn.kv_a_proj_with_mqa.weight"] = w(at, "w_kv_a_DK")[j].T
    out[f"{pre}.self_attn.kv_a_layernorm.weight"] = a(at.kv_a_norm)[j]
    kvb = w(at, "w_kv_b_LHX")[j]
    out[f"{pre}.self_attn.kv_b_proj.weight"] = kvb.reshape(kvb.shape[0], -1).T
    o = w(at, "w_o_HVD")[j]
    out[f"{pre}.self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
    if at.cfg.q_lora_rank is not None:
        out[f"{pre}.self_attn.q_a_proj.weight"] = w(at, "w_q_a_DQ")[j].T
        out[f"{pre}.self_attn.q_a_layernorm.weight"] = a(at.q_a_norm)[j]
        qb = w(at, "w_q_b_QHK")[j]
        out[f"{pre}.self_attn.q_b_proj.weight"] = qb.reshape(qb.shape[0], -1).T
    else:
        q = w(at, "w_q_DHK")[j]
        out[f"{pre}.self_attn.q_proj.weight"] = q.reshape(q.shape[0], -1).T
    ffn = stack.ffn
    if dense:
        _put_mlp(out, f"{pre}.mlp", w(ffn, "w_gate_up_D2F")[j], w(ffn, "w_down_FD")[j])
        return
    out[f"{pre}.mlp.gate.weight"] = a(ffn.router_DE)[j].T
    out[f"{pre}.mlp.gate.e_score_correction_bias"] = a(ffn.router_bias_E)[j]
    gu, dn = w(ffn, "w_gate_up_ED2I")[j], w(ffn, "w_down_EID")[j]
    for e in range(gu.shape[0]):
        _put_mlp(out, f"{pre}.mlp.experts.{e}", gu[e], dn[e])
    if ffn.shared is not None:
        _put_mlp(out, f"{pre}.mlp.shared_experts", w(ffn.shared, "w_gate_up_D2F")[j], w(ffn.shared, "w_down_FD")[j])


def _put_mlp(out: dict, pre: str, gate_up_D2F: np.ndarray, down_FD: np.ndarray) -> None:
    out[f"{pre}.gate_proj.weight"] = np.ascontiguousarray(gate_up_D2F[:, 0].T)
    out[f"{pre}.up_proj.weight"] = np.ascontiguousarray(gate_up_D2F[:, 1].T)
    out[f"{pre}.down_proj.weight"] = np.ascontiguousarray(down_FD.T)


def save_hf_checkpoint(model: DeepseekV3, out_dir: str | Path, dtype=np.float32, mtp: MTPLayer | None = None) -> None:
    """Write `model` (and its MTP layer `mtp`) as a Hugging Face checkpoint; config.json declares
    num_nextn_predict_layers as written (1 with `mtp`, else 0)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in hf_state_dict(model, mtp).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.cfg.with_(num_nextn_predict_layers=int(mtp is not None))
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
    log.info("saved %d tensors to %s", len(tensors), out)


def load_mtp(path: str, dtype="bfloat16", *, seed: int = 0, quantization: str | None = None,
             k: int = 0) -> tuple[ModelConfig, MTPLayer]:
    """(ModelConfig, MTP layer k on one device) for a checkpoint directory or a preset; see `build_mtp`."""
    layout = Layout()
    sharded = build_mtp(path, layout, layout.make_mesh(jax.devices()[:1]), dtype, seed=seed,
                        quantization=quantization, k=k)
    return sharded.cfg, sharded.merge()


def load_model(path: str, dtype="bfloat16", *, seed: int = 0, num_layers: int | None = None,
               tiny_width: bool = False, quantization: str | None = None) -> tuple[ModelConfig, DeepseekV3]:
    """(ModelConfig, the whole model on one device) for a checkpoint directory, an orbax conversion or a
    preset name with random weights (seeded); see `build_model`."""
    layout = Layout()
    sharded = build_model(path, layout, layout.make_mesh(jax.devices()[:1]), dtype, seed=seed,
                          quantization=quantization, num_layers=num_layers, tiny_width=tiny_width)
    return sharded.cfg, sharded.merge()


def default_model_path() -> Path:
    """The embedded default model shipped with jaxdp (trained by `python -m jaxdp.train`)."""
    return Path(__file__).resolve().parent.parent / "assets" / "default-model"
