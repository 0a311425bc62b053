"""What an Engine needs before its loop starts: the step runners on their meshes (the one construction
path), the tokenizer, the persistent compilation cache (for entry points to turn on), the steps compiled
ahead of time, and the stop-string check that needs the tokenizer."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxdp.batch import SAMPLING_KEYS, STEP_FIELDS, empty_spec, empty_step
from jaxdp.config import PRESETS
from jaxdp.engine.options import ModelOptions
from jaxdp.engine.sched.request import MAX_LOGPROB_TOKEN_IDS
from jaxdp.engine.step.controls import SamplingControls
from jaxdp.engine.step.prompt_logprobs import prompt_logprobs
from jaxdp.engine.step.sampling import sample_tokens, top_logprobs
from jaxdp.eplb.slots import initial_placement, with_expert_slots
from jaxdp.layout import ensure_host_devices, parse_mesh_spec
from jaxdp.model.checkpoint import stored_float_dtype
from jaxdp.model.loader import build_model, build_mtp, default_model_path
from jaxdp.model.modelopt import read_quant_config
from jaxdp.model.sharded import ShardedModel, describe_weight_bytes
from jaxdp.ops.attention import decode_kernels
from jaxdp.ops.platform import default_dtype
from jaxdp.ops.registry import deterministic_model_refusal, fp8_gemm_backend, moe_runner_backend
from jaxdp.parallel.dcp import check_dcp_pool
from jaxdp.parallel.spec_step import run_spec_step
from jaxdp.parallel.step import StepOptions, StepRunner
from jaxdp.tokenizer import Tokenizer

if TYPE_CHECKING:
    from jaxdp.engine.step.buckets import Buckets

log = logging.getLogger("jaxdp.setup")


def enable_compilation_cache(directory: str | None) -> None:
    """Turn on JAX's persistent compilation cache, so a restart does not compile the buckets again; None
    or '' leaves it off. This changes JAX's global configuration: entry points call it (serve's
    --compilation-cache-dir), a library constructor does not."""
    if not directory:
        return
    path = os.path.expanduser(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def compile_steps(runner: StepRunner, sample, buckets: Buckets, dp: int, vocab: int,
                  controls: SamplingControls | None = None) -> None:
    """Compile every step shape and its sampling ahead of time, and run each once on padding (the stand-in for
    CUDA graph capture, which runs the forward too); with `controls` (a real runner's), the sampling is theirs
    (`jaxdp.engine.step.controls.sample_with_controls`: a logit bias, penalties, a grammar's bitmask)."""
    from tqdm import tqdm

    shapes = buckets.shapes()
    t0 = time.perf_counter()
    for shape in tqdm(shapes, desc="Compiling steps", unit="step", disable=None):
        runner.compile(shape)
        run_idle(runner, shape, dp)
        if shape.draft_tokens:  # a speculative step samples inside itself
            continue
        idle = empty_step(dp, 1, shape.num_seqs, 1, 0)
        logits = runner.put(np.zeros((dp, shape.num_seqs, vocab), np.float32))
        params = [runner.put(idle[k]) for k in SAMPLING_KEYS]
        if controls is not None:
            jax.block_until_ready(controls.sample(logits, params, idle, None, 0, runner.token_carry))
        else:
            jax.block_until_ready(sample(logits, *params, width=runner.token_carry))
        if sample is sample_tokens:  # (a stand-in runner has no real logits)
            chosen = runner.put(np.zeros((dp, shape.num_seqs, MAX_LOGPROB_TOKEN_IDS), np.int32))
            jax.block_until_ready(top_logprobs(logits, chosen))
            if shape.all_logits:  # the every-row variant's reduction (jaxdp.engine.step.prompt_logprobs)
                T = shape.num_rows
                rows = runner.put(np.zeros((dp, T, vocab), np.float32))
                asks = (np.zeros((dp, shape.num_seqs), np.int32), np.zeros((dp, T), np.int32),
                        np.zeros((dp, T, MAX_LOGPROB_TOKEN_IDS), np.int32))
                jax.block_until_ready(prompt_logprobs(rows, *(runner.put(a) for a in asks)))
    if controls is not None:
        controls.warm()
    log.info("compiled %d step shapes in %.1f s (decode buckets %s; extend buckets %s; page-table widths %s)",
             len(shapes), time.perf_counter() - t0, buckets.decode, buckets.extend, list(buckets.pages))


def run_idle(runner: StepRunner, shape, dp: int) -> None:
    """Run the compiled step of `shape` once with every rank idle (all padding: its cache writes land past the
    pool's end and are dropped). An executable's first run costs far more than the next ones (XLA:CPU: 50-250 ms
    more for a speculative step of the default model, measured in docs/speculative.md); paid here, not by the
    first request whose batch takes that shape."""
    pad_slot = runner.num_pages * runner.page_size
    arrays = empty_step(dp, shape.num_rows, shape.num_seqs, shape.pages_per_seq, pad_slot)
    arrays["rows_R"] = np.zeros(dp, np.int32)
    arrays["logits_idx_B"] = np.zeros((dp, shape.num_logits), np.int32)  # (every row's, in the all_logits shape)
    if shape.draft_tokens:
        arrays |= empty_spec(dp, shape.num_rows, shape.num_requests, shape.draft_tokens, pad_slot)
        arrays["seqs_R"] = np.zeros(dp, np.int32)
        jax.block_until_ready(run_spec_step(runner, shape, arrays))
    else:
        jax.block_until_ready(runner.run(shape, {k: arrays[k] for k in (*STEP_FIELDS, "rows_R")}))


def find_tokenizer(model):
    """The tokenizer beside a checkpoint the engine builds its runner from (none for a preset or a ready runner)."""
    path = model.path if isinstance(model, ModelOptions) else model
    if not isinstance(path, str) or path in PRESETS:
        return None
    return Tokenizer.from_dir(default_model_path() if path == "default" else path)


def model_options(model: str | None | ModelOptions, **options) -> ModelOptions:
    """`model` as ModelOptions: a checkpoint directory, "default" or a preset with ModelOptions' other fields as
    keywords, or ModelOptions (with some fields changed by the keywords)."""
    if isinstance(model, ModelOptions):
        return dataclasses.replace(model, **options)
    return ModelOptions(model, **options)


def build_runners(model: str | None | ModelOptions, layout, meshes: list, *, num_pages: int, page_size: int,
                  **options) -> list[StepRunner]:
    """The one construction path (serve, Engine, one_batch): the model (`model_options(model, **options)`) built
    in its final sharding on the first mesh (`jaxdp.model.loader.build_model`), copied device to device onto each
    further replica's mesh, one StepRunner per mesh, each with a pool of `num_pages` pages of `page_size` tokens
    per rank. Logs what the weights take per device, by dtype. A dtype of "auto" is decided here, where JAX
    knows its devices (`jaxdp.ops.platform.default_dtype`)."""
    o = model_options(model, **options)
    if o.dtype == "auto":
        o = dataclasses.replace(o, dtype=default_dtype(stored_float_dtype(o.path) if o.path else None))
    gemm = fp8_gemm_backend(o.fp8_gemm_backend, deterministic=o.deterministic)
    check_dcp_pool(o.dcp_size, layout.tp, page_size)  # (before the weights load)
    first = build_model(o.path, layout, meshes[0], o.dtype, seed=o.seed, quantization=o.quantization,
                        num_layers=o.num_layers, tiny_width=o.tiny_width, fp8_gemm_backend=gemm)
    if o.deterministic and (why := deterministic_model_refusal(  # (the server refused it before loading)
            first.cfg, o.quantization, bool(o.path and Path(o.path).is_dir() and read_quant_config(o.path)))):
        raise ValueError(why)
    if o.ep_num_redundant_experts or o.init_expert_location:  # redundant experts: E + R slots and the map
        placement = initial_placement(first.cfg, layout, o.ep_num_redundant_experts, o.init_expert_location)
        first = with_expert_slots(first, placement, layout, meshes[0], o.ep_dispatch_algorithm)
    log.info("Model %s built on the mesh; %s", o.path or "default", describe_weight_bytes(first.state))
    draft = None
    if o.draft:  # speculative decoding's draft model: the checkpoint's MTP layer, placed as the layers are
        draft = build_mtp(o.path, layout, meshes[0], o.dtype, seed=o.seed, quantization=o.quantization,
                          num_layers=o.num_layers, tiny_width=o.tiny_width, fp8_gemm_backend=gemm)
    step = StepOptions(decode_kernel=decode_kernels(o.attention_backend, deterministic=o.deterministic),
                       moe_backend=moe_runner_backend(o.moe_backend, deterministic=o.deterministic),
                       index_key_dtype=o.index_key_dtype, dcp_size=o.dcp_size)
    runners = []
    for i, mesh in enumerate(meshes):
        copies = [first] if draft is None else [first, draft]
        if i > 0:  # another replica: the same arrays, copied device to device in the same specs
            copies = [ShardedModel(c.cfg, c.graphdef, jax.tree.map(
                lambda x, m=mesh: jax.device_put(x, NamedSharding(m, x.sharding.spec)), c.state)) for c in copies]
        runners.append(StepRunner(copies[0], layout, mesh, num_pages=num_pages, page_size=page_size, options=step,
                                  draft=copies[1] if draft is not None else None))
    return runners


def make_runner(options: ModelOptions, mesh, num_pages: int, page_size: int) -> StepRunner:
    """The runner an Engine builds for itself from ModelOptions and a --mesh spec (or Layout)."""
    layout = parse_mesh_spec(mesh) if isinstance(mesh, str) else mesh
    ensure_host_devices(layout.world)
    devices = jax.devices()[: layout.world]
    layout.validate(num_devices=len(jax.devices()))
    layout.check_memory(devices)  # before the KV pool is sized
    return build_runners(options, layout, [layout.make_mesh(devices)], num_pages=num_pages, page_size=page_size)[0]
