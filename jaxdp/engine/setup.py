"""What an Engine needs before its loop starts: the step runner on its mesh, the tokenizer, the
persistent compilation cache, and the stop-string check that needs the tokenizer."""

from __future__ import annotations

import jax

from jaxdp.engine.request import Request
from jaxdp.parallel.step import StepRunner


def enable_compilation_cache(directory: str | None) -> None:
    """Turn on JAX's persistent compilation cache, so a restart does not compile the buckets again."""
    if not directory:
        return
    import os

    path = os.path.expanduser(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def find_tokenizer(model):
    from jaxdp.config import PRESETS
    from jaxdp.model.loader import default_model_path
    from jaxdp.tokenizer import Tokenizer

    if not isinstance(model, str) or model in PRESETS:
        return None
    return Tokenizer.from_dir(default_model_path() if model == "default" else model)


def stop_string_check(tokenizer, stops: list[str]):
    """True once the decoded output contains a stop string (the text is cut there by the API layer)."""
    def check(req: Request) -> bool:
        tail = tokenizer.decode([t for t in req.output_ids[-32:] if t >= 0])  # negative: still in flight
        return any(s in tail for s in stops)

    return check


def make_runner(model: str, mesh, cfg, dtype: str, attention_backend, seed: int, quantization: str | None = None,
                moe_backend: str | None = None) -> StepRunner:
    from jaxdp.backends import decode_kernel, moe_runner_backend
    from jaxdp.layout import ensure_host_devices, parse_mesh_spec
    from jaxdp.model.loader import load_model

    layout = parse_mesh_spec(mesh) if isinstance(mesh, str) else mesh
    ensure_host_devices(layout.world)
    devices = jax.devices()[: layout.world]
    layout.validate(num_devices=len(jax.devices()))
    layout.check_memory(devices)  # before the KV pool is sized
    _, m = load_model(model, dtype, seed=seed, quantization=quantization)
    return StepRunner(m, layout, layout.make_mesh(devices), num_pages=cfg.num_pages, page_size=cfg.page_size,
                      decode_kernel=decode_kernel(attention_backend), moe_backend=moe_runner_backend(moe_backend))
