"""Reading NVIDIA ModelOpt NVFP4 checkpoints (the "unified Hugging Face" export).

Such a directory holds `hf_quant_config.json`:

    {"producer": {"name": "modelopt", ...},
     "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", ...]}}

(newer exports also put it into config.json as `quantization_config` with `quant_method: "modelopt"`),
and for every quantized Linear `{module}.weight` uint8 [N, K/2] (E2M1, two per byte), `weight_scale`
float8_e4m3fn [N, K/16], `weight_scale_2` float32 scalar and `input_scale` float32 scalar. Modules
matching `exclude_modules` (usually attention, the router, the LM head) are plain bf16.

jaxdp keeps the routed experts NVFP4 (`jaxdp.model.moe`'s layout; gate and up of an expert share one
weight_scale_2, as ModelOpt exports them) and dequantizes any other NVFP4 weight on load (a shared
expert or dense layer that an export quantized). Activations stay bf16 (W4A16): `input_scale` is read,
checked and reported in the log, and not used.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxdp.config import ModelConfig, UnsupportedConfigError, config_from_hf_dict
from jaxdp.ops.nvfp4 import BLOCK_K, dequantize_nvfp4

log = logging.getLogger("jaxdp.modelopt")

QUANT_CONFIG_FILE = "hf_quant_config.json"


@dataclasses.dataclass(frozen=True)
class ModelOptConfig:
    quant_algo: str
    group_size: int
    exclude_modules: tuple[str, ...] = ()  # informational: the tensors present decide what is NVFP4


def _modelopt_section(model_dir: Path) -> dict | None:
    """The `quantization` settings from hf_quant_config.json, or config.json's modelopt quantization_config."""
    path = model_dir / QUANT_CONFIG_FILE
    if path.exists():
        return json.loads(path.read_text()).get("quantization", {})
    config = model_dir / "config.json"
    qc = json.loads(config.read_text()).get("quantization_config") if config.exists() else None
    return qc if qc and qc.get("quant_method") == "modelopt" else None


def read_quant_config(model_dir: str | Path) -> ModelOptConfig | None:
    """The checkpoint's ModelOpt settings, or None when it is not a ModelOpt export."""
    section = _modelopt_section(Path(model_dir))
    if section is None:
        return None
    algo = str(section.get("quant_algo"))
    if algo.upper() != "NVFP4":
        raise UnsupportedConfigError(f"{model_dir}: ModelOpt quant_algo {algo!r} is not supported; jaxdp reads "
                                     "NVFP4 ModelOpt checkpoints")
    group = int(section.get("group_size", BLOCK_K))
    if group != BLOCK_K:
        raise UnsupportedConfigError(f"{model_dir}: NVFP4 group_size {group}; jaxdp reads group_size {BLOCK_K}")
    exclude = section.get("exclude_modules") or section.get("ignore") or ()
    return ModelOptConfig("NVFP4", group, tuple(exclude))


def load_config(model_dir: str | Path) -> ModelConfig:
    """config.json without its modelopt quantization_config (read_quant_config has that)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if (raw.get("quantization_config") or {}).get("quant_method") == "modelopt":
        raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    return config_from_hf_dict(raw)


def scalar(a: np.ndarray) -> float:
    """A per-tensor scale, stored as a scalar or a one-element tensor."""
    a = np.asarray(a, np.float32)
    if a.size != 1:
        raise ValueError(f"a per-tensor NVFP4 scale must hold one value; got shape {a.shape}")
    return float(a.reshape(()))


def dequantize_weight(packed_NK2: np.ndarray, scale_NK16: np.ndarray, scale_2: np.ndarray) -> np.ndarray:
    """One NVFP4 Linear weight -> float32 [N, K] (torch's [out, in])."""
    return np.asarray(dequantize_nvfp4(packed_NK2, np.asarray(scale_NK16), np.float32(scalar(scale_2))), np.float32)


Raw = Callable[[str], np.ndarray]


def experts_are_nvfp4(has: Callable[[str], bool], cfg: ModelConfig) -> bool:
    """Whether the first MoE layer's experts are stored as NVFP4 (else they are excluded: dense)."""
    return has(f"model.layers.{cfg.num_dense_layers}.mlp.experts.0.gate_proj.weight_scale_2")


def read_nvfp4_experts(raw: Raw, has: Callable[[str], bool], pre: str, cfg: ModelConfig):
    """One layer's routed experts -> ({NVFP4 parameter name: array [E, ...]}, input scales [E, 3]
    (gate, up, down; NaN where absent))."""
    E = cfg.n_routed_experts
    out: dict[str, list[np.ndarray]] = {}
    input_scales = np.full((E, 3), np.nan, np.float32)
    for e in range(E):
        mods = [f"{pre}.mlp.experts.{e}.{p}_proj" for p in ("gate", "up", "down")]
        if not has(f"{mods[0]}.weight_scale_2"):
            raise ValueError(f"{pre}: expert {e} is not NVFP4 ({mods[0]}.weight_scale_2 is missing) while expert "
                             "0 of the first MoE layer is; jaxdp needs all routed experts in one format")
        (gp, gs, g2), (up, us, u2), (dp_, ds, d2) = [
            (raw(f"{m}.weight"), raw(f"{m}.weight_scale"), scalar(raw(f"{m}.weight_scale_2"))) for m in mods]
        gs, us, g2 = _share_scale_2(gs, g2, us, u2, f"{pre}.mlp.experts.{e}")
        for key, value in (("w_gate_up_packed", np.stack([gp, up])), ("w_gate_up_scale", np.stack([gs, us])),
                           ("w_gate_up_gscale", np.float32(g2)), ("w_down_packed", dp_), ("w_down_scale", ds),
                           ("w_down_gscale", np.float32(d2))):
            out.setdefault(key, []).append(value)
        for j, m in enumerate(mods):
            if has(f"{m}.input_scale"):
                input_scales[e, j] = scalar(raw(f"{m}.input_scale"))
    return {key: np.stack(values) for key, values in out.items()}, input_scales


def _share_scale_2(scale_g, s2_g: float, scale_u, s2_u: float, where: str):
    """Gate and up must share one weight_scale_2 (ModelOpt exports them so); if an export did not, fold
    the ratio into the smaller one's E4M3 block scales (re-rounded) and warn."""
    if s2_g == s2_u:
        return scale_g, scale_u, s2_g
    log.warning("%s: gate and up have different weight_scale_2 (%g, %g); folding into the block scales",
                where, s2_g, s2_u)
    shared = max(s2_g, s2_u)

    def fold(scale, s2):
        return (scale.astype(np.float32) * np.float32(s2 / shared)).astype(scale.dtype)

    return fold(scale_g, s2_g), fold(scale_u, s2_u), shared


def describe_input_scales(input_scales: list[np.ndarray]) -> str:
    """A log line for the experts' input_scale values (recorded, not used: activations stay bf16)."""
    values = np.concatenate([s.reshape(-1) for s in input_scales]) if input_scales else np.zeros(0)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return "ModelOpt NVFP4 experts: no input_scale tensors"
    if not np.all(np.isfinite(values) & (values > 0)):
        raise ValueError("ModelOpt input_scale values must be positive and finite")
    return (f"ModelOpt NVFP4 experts: {values.size} input_scale values in [{values.min():.3g}, {values.max():.3g}] "
            "read and not used (activations stay bf16: W4A16)")
