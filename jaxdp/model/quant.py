"""Quantized routed experts at the model level: which method a model's experts use, and turning a
dense model's experts into NVFP4 (`--quantization nvfp4`). The format and the matmuls are in
`jaxdp.model.moe` and `kernels_pallas`; attention, the shared expert and dense layers stay dense.
"""

from __future__ import annotations

QUANTIZATIONS = ("nvfp4",)


def check_quantization(method: str | None) -> str | None:
    if method not in (None, *QUANTIZATIONS):
        raise ValueError(f"--quantization {method!r} is not one of {', '.join(QUANTIZATIONS)}")
    return method


def expert_quantization(model) -> str | None:
    """"nvfp4" when the model's routed experts are held as NVFP4, None when dense (or no MoE layers)."""
    return None if model.moe_layers is None else model.moe_layers.ffn.quantization


def quantize_experts(model, method: str | None):
    """Quantize the routed experts of every MoE layer in place (None: leave them); returns the model."""
    if check_quantization(method) and model.moe_layers is not None:
        model.moe_layers.ffn.to_nvfp4()
    return model


def with_moe_runner_backend(model, backend: str):
    """The model with its MoE layers' runner backend set (a static field, so compiled in); the given
    model is not changed (its arrays are shared)."""
    from flax import nnx

    if model.moe_layers is None or model.moe_layers.ffn.runner_backend == backend:
        return model
    copy = nnx.merge(*nnx.split(model))
    copy.moe_layers.ffn.runner_backend = backend
    return copy
