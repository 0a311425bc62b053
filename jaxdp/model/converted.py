"""jaxdp's own converted checkpoints (`python -m jaxdp.quantize` writes them): OUT/config.json (Hugging Face
names, for tools), OUT/jaxdp_checkpoint.json (the format, the quantization and the full ModelConfig) and
OUT/state (the model's parameters, orbax). `jaxdp.model.loader` detects such a directory and restores it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.config import ModelConfig, hf_config_dict
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.quant import apply_quantization, expert_quantization

MARKER = "jaxdp_checkpoint.json"
FORMAT = "jaxdp-orbax-v1"


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_converted(model: DeepseekV3, out: str | Path) -> Path:
    """Write the model (its experts dense or NVFP4, as they are) to `out` in the format above."""
    import orbax.checkpoint as ocp

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg  # fp8_block set: the layers' Linear weights are saved in block FP8 as held
    quantization = expert_quantization(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / "state", nnx.state(model), force=True)
    checkpointer.wait_until_finished()
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
    meta = {"format": FORMAT, "quantization": quantization,
            "experts": None if quantization is None else {"format": "NVFP4 (ModelOpt layout)", "group_size": 16,
                                                          "layout": "see jaxdp/model/moe.py"},
            "dtype": str(model.embed_VD.get_value().dtype), "model_config": dataclasses.asdict(cfg)}
    (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_converted(path: str | Path, dtype=jnp.bfloat16) -> tuple[ModelConfig, DeepseekV3]:
    """Restore a directory written by `save_converted`; dense weights come back in `dtype`."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    meta = json.loads((path / MARKER).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path / MARKER} has format {meta.get('format')!r}; this jaxdp reads {FORMAT!r}")
    raw = dict(meta["model_config"])
    for key in ("fp8_block", "eos_token_id"):
        if isinstance(raw.get(key), list):
            raw[key] = tuple(raw[key])
    cfg = ModelConfig(**raw)
    abstract = nnx.eval_shape(lambda: apply_quantization(DeepseekV3(cfg, nnx.Rngs(0), dtype), meta["quantization"]))
    graphdef, abstract_state = nnx.split(abstract)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract_state)
    state = ocp.StandardCheckpointer().restore(path / "state", target)
    return cfg, nnx.merge(graphdef, state)
