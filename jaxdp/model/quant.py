"""Quantized weights at the model level: which method a model's experts use, and turning a dense model
into a quantized one. `nvfp4` (`--quantization nvfp4`) holds the routed experts in NVFP4 (the format
and the matmuls are in `jaxdp.model.moe` and `jaxdp.ops`; attention, the shared expert and dense
layers stay dense). `fp8` holds every Linear weight of the layers in DeepSeek's block FP8, as an FP8
checkpoint does (`jaxdp.model.fp8`); a model whose config has `fp8_block` is held that way.
"""

from __future__ import annotations

from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.fp8 import to_fp8
from jaxdp.ops.registry import OPS

QUANTIZATIONS = ("nvfp4", "fp8")
FP8_BLOCK = (128, 128)  # DeepSeek's block, used when a bf16 checkpoint is quantized at load


def check_quantization(method: str | None) -> str | None:
    if method not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization {method!r} is not one of {', '.join(QUANTIZATIONS)}")
    return method


def resolve_quantization(cfg: ModelConfig, method: str | None) -> tuple[ModelConfig, str | None]:
    """(the config the model is built with, the experts' quantization): `fp8` sets the config's FP8
    block (a block-FP8 checkpoint's config has one already); `nvfp4` is the experts'."""
    if check_quantization(method) == "fp8":
        return cfg.with_(fp8_block=cfg.fp8_block or FP8_BLOCK), None
    return cfg, method


def apply_quantization(model, method: str | None):
    """Quantize in place: the routed experts to NVFP4 (`method="nvfp4"`), then, when the model's config
    has an FP8 block, the layers' Linear weights to block FP8. Returns the model."""
    quantize_experts(model, method)
    if model.cfg.fp8_block:
        to_fp8(model, model.cfg.fp8_block[0], model.embed_VD.get_value().dtype)
    return model


def expert_quantization(model) -> str | None:
    """"nvfp4" when the model's routed experts are held as NVFP4, None when dense (or no MoE layers)."""
    return None if model.moe_layers is None else model.moe_layers.ffn.quantization


def quantize_experts(model, method: str | None):
    """Quantize the routed experts of every MoE layer in place (None: leave them); returns the model."""
    if check_quantization(method) == "nvfp4" and model.moe_layers is not None:
        model.moe_layers.ffn.to_nvfp4()
    return model


def with_moe_runner_backend(model, backend: str):
    """The model with its MoE layers' runner backend set (a static field, so compiled in); the given
    model is not changed (its arrays are shared)."""
    if model.moe_layers is None or model.moe_layers.ffn.runner_backend == backend:
        return model
    copy = nnx.merge(*nnx.split(model))
    copy.moe_layers.ffn.runner_backend = backend
    return copy


def with_fp8_gemm_backend(model, backend: str | None):
    """The model (or MTP layer) with the projection GEMM's backend (`--fp8-gemm-backend`: one of the registry's
    `projection_gemm` backends) set on every module, a static field each weight it reads in place carries
    (`jaxdp.model.fp8.weight`); None leaves the model as it is (the platform's default, picked where the step is
    lowered). The given model is not changed (its arrays are shared)."""
    if backend is None:
        return model
    if backend not in OPS["projection_gemm"].backends:
        raise ValueError(f"--fp8-gemm-backend {backend!r} is not one of {', '.join(OPS['projection_gemm'].backends)}")
    copy = nnx.merge(*nnx.split(model))
    for _, module in nnx.iter_modules(copy):
        module.gemm_backend = backend
    return copy
