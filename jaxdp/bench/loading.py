"""`python -m jaxdp.bench.loading`: load time and peak host memory of a real-width checkpoint beside
the time to read its files once.

    python -m jaxdp.bench.loading --dir /tmp/ckpt [--fp8] [--layers 2] [--experts 8] [--mesh tp=8]

writes (once) a synthetic DeepSeek-V3-width checkpoint (hidden 7168, 128 heads, q/kv LoRA 1536/512,
vocab 32768; bf16, or DeepSeek's block FP8 with `--fp8`), evicts its files from the page cache (drop_caches
as root, else posix_fadvise DONTNEED), times one sequential read of them, evicts them again, and loads the model
with the serving construction path (`jaxdp.engine.setup.build_runners`) in a child process that reports
its peak RSS. Prints a table and writes JSON (`--json`). `write_checkpoint` is also what the tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxdp.config import ModelConfig, hf_config_dict

REAL_WIDTH = dict(vocab_size=32768, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                  num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)


def real_width_config(layers: int = 2, experts: int = 8, **overrides) -> ModelConfig:
    return ModelConfig(**{**REAL_WIDTH, "num_layers": layers, "n_routed_experts": experts, **overrides})


def _torch_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and [out, in] shapes of a DeepSeek-V3 checkpoint of this config."""
    D, H, K = cfg.hidden_size, cfg.num_heads, cfg.qk_head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,),
           "lm_head.weight": (cfg.vocab_size, D)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": (D,), f"{p}.post_attention_layernorm.weight": (D,),
                f"{p}.self_attn.q_a_proj.weight": (cfg.q_lora_rank, D),
                f"{p}.self_attn.q_a_layernorm.weight": (cfg.q_lora_rank,),
                f"{p}.self_attn.q_b_proj.weight": (H * K, cfg.q_lora_rank),
                f"{p}.self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_cache_dim, D),
                f"{p}.self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                f"{p}.self_attn.kv_b_proj.weight": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                f"{p}.self_attn.o_proj.weight": (D, H * cfg.v_head_dim)}
        mlps = [(f"{p}.mlp", cfg.intermediate_size)] if i < cfg.num_dense_layers else (
            [(f"{p}.mlp.experts.{e}", cfg.moe_intermediate_size) for e in range(cfg.n_routed_experts)]
            + [(f"{p}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts)])
        if i >= cfg.num_dense_layers:
            out |= {f"{p}.mlp.gate.weight": (cfg.n_routed_experts, D),
                    f"{p}.mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,)}
        for m, inter in mlps:
            out |= {f"{m}.gate_proj.weight": (inter, D), f"{m}.up_proj.weight": (inter, D),
                    f"{m}.down_proj.weight": (D, inter)}
    return out


def _random(rng, shape, dtype) -> np.ndarray:
    """Cheap random values of moderate size: random bits with the exponent fixed (|x| in [2^-k, 2^-k+1))."""
    if dtype == "fp8":  # e4m3: sign, 4 exponent, 3 mantissa bits
        bits = rng.integers(0, 256, size=shape, dtype=np.uint8)
        return ((bits & 0x87) | 0x30).view(ml_dtypes.float8_e4m3fn)
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)  # bf16: sign, 8 exponent, 7 mantissa bits
    return ((bits & 0x807F) | 0x3C00).view(ml_dtypes.bfloat16)


def is_fp8_weight(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek's FP8 checkpoints store in FP8: the layers' Linear weights (not the router)."""
    return len(shape) == 2 and "proj" in name and name.startswith("model.layers.")


def write_checkpoint(out_dir: str | Path, cfg: ModelConfig, fp8: bool = False, seed: int = 0,
                     shard_bytes: int = 512 << 20) -> int:
    """A random checkpoint of `cfg` in bf16 (or block FP8, 128x128 scales that are powers of two) as
    safetensors shards of about `shard_bytes` with an index; returns its size in bytes. Memory: one shard."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shard: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    n = 0

    def flush():
        nonlocal shard, n
        if shard:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            shard, n = {}, n + 1

    for name, shape in _torch_shapes(cfg).items():
        if fp8 and is_fp8_weight(name, shape):
            shard[name] = _random(rng, shape, "fp8")
            blocks = tuple(-(-d // 128) for d in shape)
            shard[name.replace(".weight", ".weight_scale_inv")] = np.exp2(
                rng.integers(-12, -6, size=blocks)).astype(np.float32)
        elif name.endswith("e_score_correction_bias"):
            shard[name] = np.zeros(shape, np.float32)
        elif "norm" in name:
            shard[name] = np.ones(shape, ml_dtypes.bfloat16)
        else:
            shard[name] = _random(rng, shape, "bf16")
        if sum(a.nbytes for a in shard.values()) >= shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raw = hf_config_dict(cfg) | {"torch_dtype": "bfloat16"}
    if fp8:
        raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                                      "activation_scheme": "dynamic"}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def evict(model_dir: str | Path) -> str:
    """Drop the checkpoint's files from the page cache (so the next read comes from the disk): the whole
    page cache when this process may (root: /proc/sys/vm/drop_caches), else the files' pages
    (posix_fadvise DONTNEED, which a kernel may ignore for pages another process maps). Returns which."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        pass
    for p in Path(model_dir).glob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return "fadvise"


def read_once(model_dir: str | Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) to read every safetensors file once, sequentially, in 64 MiB blocks."""
    t0, c0 = time.perf_counter(), time.process_time()
    buf = bytearray(64 << 20)
    for p in sorted(Path(model_dir).glob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0, time.process_time() - c0


LOAD_SCRIPT = """
import json, resource, sys, time
from jaxdp.layout import ensure_host_devices, parse_mesh_spec
layout = parse_mesh_spec(sys.argv[2]); ensure_host_devices(layout.world)
import jax
from jaxdp.engine.setup import build_runners
from jaxdp.model.sharded import weight_bytes_per_device
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
cpu = lambda: (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_SELF))
t0, c0 = time.perf_counter(), cpu()
mesh = layout.make_mesh(jax.devices()[:layout.world])
if sys.argv[5]:  # the devices' path forced (what a GPU runs): the loader alone
    from jaxdp.model.sharded import load_sharded
    state = load_sharded(sys.argv[1], layout, mesh, sys.argv[3], sys.argv[4] or None, transpose_on_devices=True).state
else:
    state = build_runners(sys.argv[1], layout, [mesh], dtype=sys.argv[3], quantization=sys.argv[4] or None,
                          num_pages=2, page_size=16)[0].state
jax.block_until_ready(state)
print(json.dumps({"load_s": time.perf_counter() - t0, "load_cpu_s": cpu() - c0,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss_before_load_bytes": before,
                  "weights_per_device": weight_bytes_per_device(state)}))
"""


def load_in_child(model_dir: str | Path, mesh: str = "tp=8", dtype: str = "bfloat16",
                  quantization: str | None = None, transpose_on_devices: bool = False) -> dict:
    """Load in a fresh process (its peak RSS is the loader's alone); returns load_s, peak_rss_bytes, ...
    `transpose_on_devices`: the path a GPU takes (torch's layout placed as stored, transposed by the devices)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(model_dir), mesh, dtype, quantization or "",
                          "devices" if transpose_on_devices else ""],
                         capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"loading {model_dir} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.loading", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the synthetic checkpoint is (written if absent)")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (DeepSeek's format)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--mesh", default="tp=8")
    ap.add_argument("--transpose-on-devices", action="store_true",
                    help="force the path a GPU takes: torch's [out, in] placed as stored, transposed by the devices")
    ap.add_argument("--json", help="write the figures here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = real_width_config(args.layers, args.experts)
    if not (Path(args.dir) / "config.json").exists():
        write_checkpoint(args.dir, cfg, fp8=args.fp8)
    size = sum(p.stat().st_size for p in Path(args.dir).glob("*.safetensors"))
    load_before = os.getloadavg()[0]
    evicted = evict(args.dir)
    read_s, read_cpu_s = read_once(args.dir)
    evict(args.dir)
    got = load_in_child(args.dir, args.mesh, transpose_on_devices=args.transpose_on_devices)
    row = {"checkpoint": "block-FP8" if args.fp8 else "bf16", "size_gib": size / 2**30, "read_once_s": read_s,
           "read_GBps": size / read_s / 1e9, "read_cpu_s": read_cpu_s, "load_s": got["load_s"],
           "load_cpu_s": got["load_cpu_s"], "load_over_read": got["load_s"] / read_s,
           "load_GBps": size / got["load_s"] / 1e9, "load_GBps_per_cpu_s": size / got["load_cpu_s"] / 1e9,
           "peak_rss_gib": got["peak_rss_bytes"] / 2**30, "rss_over_size": got["peak_rss_bytes"] / size,
           "transpose_on_devices": args.transpose_on_devices, "mesh": args.mesh, "cpus": os.cpu_count(),
           "evicted_with": evicted,
           "loadavg_1min_before": load_before,
           "loadavg_1min_after": os.getloadavg()[0]}
    print(f"{row['checkpoint']} {size / 2**30:.2f} GiB, --mesh {args.mesh} on 8 host devices, {row['cpus']} CPUs, "
          f"1-min load average {load_before:.1f} before / {row['loadavg_1min_after']:.1f} after (others' work "
          "slows both figures; compare ratios from one run):")
    print(f"  read the files once, cold ({evicted}):  {read_s:6.2f} s wall, {read_cpu_s:6.2f} s CPU "
          f"({row['read_GBps']:.2f} GB/s)")
    print(f"  load onto the mesh, cold:   {row['load_s']:6.2f} s wall, {row['load_cpu_s']:6.2f} s CPU "
          f"({row['load_GBps']:.2f} GB/s)  -> load / read {row['load_over_read']:.2f} (goal <= 2)")
    print(f"  peak RSS of the loading process: {row['peak_rss_gib']:.2f} GiB = {row['rss_over_size']:.2f} x the "
          "checkpoint (tests bound it by 1.2 x + 1 GiB)")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
