"""The server's flags as one checked ServeConfig: the model's options, the engine's config, each replica's KV pool
sizing and the HTTP limits (`serve_config`); every flag a user can get wrong is refused here in one sentence
(`UserError`), before anything loads. `python -m jaxdp.serve` (jaxdp/serve.py) parses the flags and starts
what this describes.

KV pool per rank: --max-total-tokens N gives it N tokens. Otherwise, on a GPU, every device may hold
--mem-fraction-static of its memory (JAX's bytes_limit) for weights and KV cache: the pool is what that leaves after
the weights (measured with memory_stats once they are sharded), the rest of the memory is for activations. On a
CPU, where memory_stats is unavailable, the pool is --mem-fraction-static x 256 MiB per rank. --replica-num-pages
A,B,... sizes each replica's pool on its own (to reproduce unequal replicas).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxdp.api.context import Limits
    from jaxdp.engine.options import EngineConfig, ModelOptions

CPU_KV_BUDGET = 2**28  # bytes per rank on a CPU (256 MiB), times --mem-fraction-static


class UserError(ValueError):
    """A flag (or flags together) the user must change; its message says which, in one sentence."""


def server_limits(args):
    """The HTTP limits of `args`, checked (a UserError names the flag)."""
    from jaxdp.api.context import Limits

    for name, low in (("max_request_bytes", 1024), ("max_queued_requests", 1), ("request_timeout", 1e-3),
                      ("graceful_shutdown_timeout", 1e-3)):
        if (value := getattr(args, name)) is not None and not value >= low:
            raise UserError(f"--{name.replace('_', '-')} must be at least {low:g}, got {value}")
    return Limits(args.max_request_bytes, args.max_queued_requests, args.request_timeout,
                  args.graceful_shutdown_timeout)


def engine_config(args, num_pages: int | None = None):
    """The engine's options from the flags, checked (a UserError names the flag). `num_pages` unset: the
    runner's (each replica's pool is sized from the memory it has, `pool_pages`)."""
    from jaxdp.engine import EngineConfig
    from jaxdp.engine.sched.delayer import DelayerConfig
    from jaxdp.parallel.accounting import decode_buckets

    buckets = args.cuda_graph_bs
    if buckets is None and args.cuda_graph_max_bs is not None:
        buckets = decode_buckets(args.cuda_graph_max_bs)
    for name in ("page_size", "chunked_prefill_size", "max_running_requests"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if buckets is not None and min(buckets) < 1:
        raise UserError("--cuda-graph-bs sizes must be at least 1")
    delayer = None
    passes, watermark = args.prefill_delayer_max_delay_passes, args.prefill_delayer_token_usage_low_watermark
    if args.enable_prefill_delayer:
        delayer = DelayerConfig(30 if passes is None else passes, watermark).validate()
    elif passes is not None or watermark is not None:
        raise UserError("--prefill-delayer-max-delay-passes and --prefill-delayer-token-usage-low-watermark "
                        "need --enable-prefill-delayer")
    disagg = None
    if args.disaggregation_mode != "null":
        from jaxdp.disagg.transfer import TRANSPORTS
        from jaxdp.engine.options import DisaggConfig

        if args.disaggregation_transfer_backend not in TRANSPORTS:
            raise UserError(f"--disaggregation-transfer-backend {args.disaggregation_transfer_backend!r} is not "
                            f"available here; use one of: {', '.join(sorted(TRANSPORTS))}")
        if not 0 < args.disaggregation_bootstrap_port < 65536 or args.disaggregation_timeout <= 0:
            raise UserError("--disaggregation-bootstrap-port must be a port (1-65535) and --disaggregation-timeout "
                            "a positive number of seconds")
        disagg = DisaggConfig(args.disaggregation_mode, args.disaggregation_bootstrap_port,
                              args.disaggregation_transfer_backend, args.host, args.disaggregation_timeout)
    return EngineConfig(speculative=speculative_config(args),
                        page_size=args.page_size, num_pages=num_pages, max_running_requests=args.max_running_requests,
                        chunked_prefill_size=args.chunked_prefill_size, context_length=args.context_length,
                        schedule_conservativeness=args.schedule_conservativeness, decode_buckets=buckets,
                        disable_cuda_graph=args.disable_cuda_graph, load_balance_method=args.load_balance_method,
                        enable_prefix_cache=not args.disable_radix_cache, seed=args.random_seed,
                        enable_mixed_chunk=args.enable_mixed_chunk, prefill_delayer=delayer, disaggregation=disagg,
                        overlap=not args.disable_overlap_schedule)


def speculative_config(args):
    """SGLang's --speculative-* flags, with its DeepSeek defaults (3 steps, topk 1, 4 draft tokens) for what is
    not given; None without --speculative-algorithm."""
    from jaxdp.engine.options import SpeculativeConfig

    flags = ("num_steps", "eagle_topk", "num_draft_tokens", "disable_by_batch_size")
    given = [f for f in flags if getattr(args, f"speculative_{f}") is not None]
    if args.speculative_algorithm is None:
        if given:
            raise UserError(f"--speculative-{given[0].replace('_', '-')} needs --speculative-algorithm "
                            "(EAGLE or NEXTN)")
        return None
    steps = args.speculative_num_steps if args.speculative_num_steps is not None else 3
    topk = args.speculative_eagle_topk if args.speculative_eagle_topk is not None else 1
    drafts = args.speculative_num_draft_tokens if args.speculative_num_draft_tokens is not None else steps + 1
    try:
        return SpeculativeConfig(args.speculative_algorithm.upper(), steps, topk, drafts,
                                 args.speculative_disable_by_batch_size)
    except ValueError as e:
        raise UserError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class PoolSizing:
    """How each replica's KV pool is sized (see the module docstring): the flags, checked."""

    mem_fraction_static: float = 0.88
    max_total_tokens: int | None = None
    replica_num_pages: list[int] | None = None


def pool_sizing(args, page_size: int, replicas: int) -> PoolSizing:
    pages = None
    if args.replica_num_pages:
        sizes = [s.strip() for s in args.replica_num_pages.split(",")]
        if len(sizes) != replicas or not all(s.isdigit() and int(s) > 0 for s in sizes):
            raise UserError(f"--replica-num-pages {args.replica_num_pages} must give {replicas} positive page "
                            f"counts, one per replica of --dp-size {replicas}")
        pages = [int(s) for s in sizes]
    elif args.max_total_tokens is not None:
        if args.max_total_tokens < page_size:
            raise UserError(f"--max-total-tokens {args.max_total_tokens} is less than one page of {page_size} tokens")
    elif not 0 < args.mem_fraction_static <= 1:
        raise UserError(f"--mem-fraction-static {args.mem_fraction_static} must be in (0, 1]")
    return PoolSizing(args.mem_fraction_static, args.max_total_tokens, pages)


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the flags say about the model, the engines, their pools and the HTTP limits: built once from them
    (`serve_config`, which checks them) and handed down; the HTTP side reads the rest of the flags itself."""

    model: ModelOptions
    engine: EngineConfig  # (num_pages unset: each replica's runner has its own, sized by `pool`)
    pool: PoolSizing
    limits: Limits


def serve_config(args, layout) -> ServeConfig:
    """The flags as a ServeConfig (a UserError names a flag to change). After `resolve_model`: the model's path."""
    from jaxdp.engine.options import ModelOptions
    from jaxdp.ops.platform import default_dtype

    engine = engine_config(args)
    model = ModelOptions(args.model_path, args.dtype if args.dtype != "auto" else default_dtype(), args.random_seed,
                         args.quantization, args.attention_backend, args.moe_runner_backend,
                         None if args.index_key_dtype == "auto" else args.index_key_dtype,
                         draft=engine.speculative is not None, fp8_gemm_backend=args.fp8_gemm_backend)
    if engine.speculative is not None:  # before anything loads: the MTP layer is there, the options go with it
        from jaxdp.engine.step.spec import check_speculative
        from jaxdp.model.loader import check_mtp_checkpoint, default_model_path

        try:
            check_speculative(engine)
            path = args.model_path
            check_mtp_checkpoint(str(default_model_path()) if path in (None, "default") else path)
        except ValueError as e:
            raise UserError(f"--speculative-algorithm {engine.speculative.algorithm}: {e}") from None
    return ServeConfig(model, engine, pool_sizing(args, engine.page_size, layout.replicas), server_limits(args))


def pool_pages(sizing: PoolSizing, runner, replica: int) -> int:
    """KV pages per rank for one replica (see the module docstring)."""
    import jax

    from jaxdp.layout import GiB

    S = runner.page_size
    if sizing.replica_num_pages:
        return sizing.replica_num_pages[replica]
    if sizing.max_total_tokens is not None:
        return sizing.max_total_tokens // S
    fraction = sizing.mem_fraction_static
    page_bytes = S * runner.pool_bytes_per_token
    devices = [d for d in runner.mesh.devices.flat if d.process_index == jax.process_index()]  # this node's
    stats = [d.memory_stats() if hasattr(d, "memory_stats") else None for d in devices]
    if not all(s and "bytes_limit" in s for s in stats):
        return max(1, int(fraction * CPU_KV_BUDGET) // page_bytes)
    limit = min(s["bytes_limit"] for s in stats) * fraction
    used = max(s.get("bytes_in_use", 0) for s in stats)
    pages = int(limit - used) // page_bytes
    if pages < 2:
        raise UserError(f"the weights take {used / GiB:.2f} GiB of the {limit / GiB:.2f} GiB that "
                        f"--mem-fraction-static {fraction} allows per device, leaving no room "
                        "for the KV cache; raise --mem-fraction-static or spread the model over more devices")
    return pages
