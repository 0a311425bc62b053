"""`python -m jaxdp.quantize`: a checkpoint with its routed experts in NVFP4, saved with orbax.

    python -m jaxdp.quantize --model-path DIR|tiny --out OUT [--quantization nvfp4] [--dtype bfloat16]

reads a Hugging Face checkpoint (bf16, fp32 or block-FP8; or a ModelOpt NVFP4 one, kept as stored) or a
preset with random weights, quantizes the routed experts as ModelOpt does (`jaxdp.model.moe`), and
writes OUT/config.json (Hugging Face names, for tools), OUT/jaxdp_checkpoint.json (the format, the
quantization and the full ModelConfig) and OUT/state (the model's parameters, orbax). Any jaxdp entry
point takes `--model-path OUT` (`load_model` detects the directory and restores it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.config import ModelConfig
from jaxdp.model.decoder import DeepseekV3
from jaxdp.model.quant import QUANTIZATIONS, apply_quantization, expert_quantization

log = logging.getLogger("jaxdp.quantize")

MARKER = "jaxdp_checkpoint.json"
FORMAT = "jaxdp-orbax-v1"


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def save_converted(model: DeepseekV3, out: str | Path) -> Path:
    """Write the model (its experts dense or NVFP4, as they are) to `out` in the format above."""
    import orbax.checkpoint as ocp

    from jaxdp.model.loader import hf_config_dict

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True, help="Hugging Face checkpoint directory or preset (tiny, ...)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default="nvfp4")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="dtype of everything but the NVFP4 experts")
    ap.add_argument("--seed", type=int, default=0, help="random weights of a preset")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from jaxdp.model.loader import load_model

    try:
        cfg, model = load_model(args.model_path, args.dtype, seed=args.seed, quantization=args.quantization)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = save_converted(model, args.out)
    print(f"wrote {out}: {cfg.num_moe_layers} MoE layers x {cfg.n_routed_experts} experts in "
          f"{expert_quantization(model)}, the rest in {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
