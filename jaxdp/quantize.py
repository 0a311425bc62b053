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
import logging
import sys

from jaxdp.model.converted import save_converted
from jaxdp.model.loader import load_model
from jaxdp.model.quant import QUANTIZATIONS, expert_quantization

log = logging.getLogger("jaxdp.quantize")

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
