"""The server's flags as one checked ServeConfig (`serve_config`): the model's options, the engine's config, each
replica's KV pool sizing, the HTTP limits and options, the layout and the nodes. Every flag a user can get wrong is
refused here in one sentence (`UserError`), before anything loads and without starting JAX's backends.
`python -m jaxdp.serve` (jaxdp/serve.py) parses the flags, builds this once and hands it to the process's role.

KV pool per rank: --max-total-tokens N gives it N tokens. Otherwise, on a GPU, every device may hold
--mem-fraction-static of its memory (JAX's bytes_limit) for weights and KV cache: the pool is what that leaves after
the weights (measured with memory_stats once they are sharded), the rest of the memory is for activations. On a
CPU, where memory_stats is unavailable, the pool is --mem-fraction-static x 256 MiB per rank. --replica-num-pages
A,B,... sizes each replica's pool on its own (to reproduce unequal replicas).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import jax

from jaxdp.api.context import Limits
from jaxdp.api.parsers import UnknownParserError, reasoning_parser, tool_call_parser
from jaxdp.config import PRESETS, UnsupportedConfigError
from jaxdp.disagg.transfer import TRANSPORTS
from jaxdp.engine.nodes.hosts import DistConfig, check_dist_args
from jaxdp.engine.options import DisaggConfig, EngineConfig, ModelOptions, SpeculativeConfig
from jaxdp.engine.sched.delayer import DelayerConfig
from jaxdp.engine.step.spec import check_speculative
from jaxdp.eplb.distribution import RecorderError, check_dispatch_flags, check_recorder_mode, eplb_config
from jaxdp.grammar import DEFAULT_BACKEND, backend_problem
from jaxdp.layout import GiB, Layout, check_expert_location_flags, layout_from_args
from jaxdp.model.loader import check_mtp_checkpoint, default_model_path, model_config
from jaxdp.model.modelopt import read_quant_config
from jaxdp.ops.registry import deterministic_conflict, deterministic_model_refusal
from jaxdp.parallel.accounting import decode_buckets
from jaxdp.parallel.dcp import DCPError, check_dcp_pool
from jaxdp.parallel.tbo_split import check_threshold

CPU_KV_BUDGET = 2**28  # bytes per rank on a CPU (256 MiB), times --mem-fraction-static


class UserError(ValueError):
    """A flag (or flags together) the user must change; its message says which, in one sentence."""


def server_limits(args):
    """The HTTP limits of `args`, checked (a UserError names the flag)."""
    for name, low in (("max_request_bytes", 1024), ("max_queued_requests", 1), ("request_timeout", 1e-3),
                      ("graceful_shutdown_timeout", 1e-3)):
        if (value := getattr(args, name)) is not None and not value >= low:
            raise UserError(f"--{name.replace('_', '-')} must be at least {low:g}, got {value}")
    return Limits(args.max_request_bytes, args.max_queued_requests, args.request_timeout,
                  args.graceful_shutdown_timeout)


def engine_config(args, num_pages: int | None = None):
    """The engine's options from the flags, checked (a UserError names the flag). `num_pages` unset: the
    runner's (each replica's pool is sized from the memory it has, `pool_pages`)."""
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
                        overlap=not args.disable_overlap_schedule, tbo_threshold=tbo_threshold(args),
                        grammar_backend=grammar_backend(args.grammar_backend))


def tbo_threshold(args) -> float | None:
    """--enable-two-batch-overlap's threshold (None: off); one outside (0, 0.5] is refused in one sentence."""
    try:
        check_threshold(args.tbo_token_distribution_threshold)
    except ValueError as e:
        raise UserError(str(e)) from None
    return args.tbo_token_distribution_threshold if args.enable_two_batch_overlap else None


def grammar_backend(flag: str | None) -> str:
    """--grammar-backend (SGLang's names): the default is jaxdp's (llguidance), with or without
    --speculative-algorithm (a speculating server's verify checks each draft against the grammar,
    `jaxdp.engine.step.spec.verify_bitmask`)."""
    if flag is None:
        return DEFAULT_BACKEND
    problem = backend_problem(flag)
    if problem is not None:
        raise UserError(problem)
    return flag


def speculative_config(args):
    """SGLang's --speculative-* flags, with its DeepSeek defaults (3 steps, topk 1, 4 draft tokens) for what is
    not given; None without --speculative-algorithm."""
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
class HttpOptions:
    """Where and how the HTTP side listens and logs (node 0's API; a node > 0's /health)."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # every endpoint but /health needs 'Authorization: Bearer KEY'
    served_model_name: str = "default"  # what /v1/models reports
    log_level: str = "info"
    decode_log_interval: int = 40  # decode steps between a rank's Decode batch log lines


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything the flags say, checked: built once from them (`serve_config`) in the process the user started,
    and handed to the entry function of each process role (`jaxdp.serve`); the engine process receives it as a
    typed message. Nothing downstream reads the flags again."""

    model: ModelOptions  # (dtype may be "auto": decided where the model is built, once JAX knows its devices)
    engine: EngineConfig  # (num_pages unset: each replica's runner has its own, sized by `pool`)
    pool: PoolSizing
    limits: Limits
    layout: Layout  # from the flags; checked against the devices where they are (`Layout.validate`)
    dist: DistConfig
    http: HttpOptions
    tokenizer_path: str | None  # the directory to read tokenizer.json from; None: --skip-tokenizer-init
    compilation_cache_dir: str  # JAX's persistent compilation cache ('' leaves it off)
    engine_process: bool  # the engines run in a process of their own (the default on one node)
    flags: dict[str, Any]  # the flags as given, but --api-key and with the model's path: /get_server_info reports them
    tool_call_parser: str | None = None  # --tool-call-parser: SGLang's name of the checkpoint's tool-call format
    reasoning_parser: str | None = None  # --reasoning-parser: SGLang's name of the checkpoint's reasoning format


def engine_in_child(args: argparse.Namespace) -> bool:
    """Whether this server runs its engines in a child process: by default on one node, never across nodes
    (node 0's engine takes part in the model world's collectives from the server's own process)."""
    if args.engine_process and args.nnodes > 1:
        raise UserError("--engine-process runs one node's engine in a child process; drop it with --nnodes > 1, "
                        "where node 0 runs its engine in the server's process")
    return args.nnodes == 1 if args.engine_process is None else args.engine_process


def dist_config(args: argparse.Namespace) -> DistConfig:
    """The --nnodes / --node-rank / --dist-* flags, checked."""
    check_dist_args(args.nnodes, args.node_rank, args.dist_init_addr)
    if args.dist_timeout <= 0 or args.dist_init_timeout <= 0:
        raise UserError("--dist-timeout and --dist-init-timeout must be positive seconds")
    return DistConfig(args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout, args.dist_init_timeout)


def model_path(flag: str | None) -> str:
    """--model-path as the path the model loads from: the embedded model's directory when not given."""
    if flag is None:
        path = default_model_path()
        if not (path / "config.json").exists():
            raise UserError(f"the embedded default model is not installed at {path}; pass --model-path with a "
                            "checkpoint directory or a preset (tiny, deepseek-v3, glm-5)")
        return str(path)
    if flag not in PRESETS and not Path(flag).is_dir():
        raise UserError(f"--model-path {flag} is neither a checkpoint directory nor a preset "
                        f"({', '.join(sorted(PRESETS))})")
    return flag


def tokenizer_path(args: argparse.Namespace, model: str) -> str | None:
    """Where the tokenizer is read from (--tokenizer-path, else the model's directory); None with
    --skip-tokenizer-init."""
    if args.skip_tokenizer_init:
        return None
    if args.tokenizer_path and not (Path(args.tokenizer_path) / "tokenizer.json").exists():
        raise UserError(f"--tokenizer-path {args.tokenizer_path} has no tokenizer.json")
    return args.tokenizer_path or model


def chat_parsers(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """--tool-call-parser and --reasoning-parser, each None or one of the parsers' names (`jaxdp.api.parsers`)."""
    try:
        for name, make in ((args.tool_call_parser, tool_call_parser), (args.reasoning_parser, reasoning_parser)):
            if name is not None:
                make(name)
    except UnknownParserError as e:
        raise UserError(str(e)) from None
    return args.tool_call_parser, args.reasoning_parser


def serve_config(args: argparse.Namespace, layout: Layout | None = None) -> ServeConfig:
    """The flags as a ServeConfig, every one checked before anything loads (a UserError or LayoutError names a flag
    to change). `layout`: the flags' own (`layout_from_args`) unless given. Starts no JAX backend."""
    dist = dist_config(args)
    limits = server_limits(args)
    engine_process = engine_in_child(args)
    layout = layout_from_args(args) if layout is None else layout  # logs the --enable-dp-attention deprecation
    if dist.multi and layout.replicas > 1:
        raise UserError("--dp-size replicas do not span nodes; run one server per node behind a router, "
                        "or one model world with --nnodes and attention DP")
    path = model_path(args.model_path)
    tokenizer = tokenizer_path(args, path)
    tool_parser, thinking_parser = chat_parsers(args)
    engine = engine_config(args)
    model = ModelOptions(path, args.dtype, args.random_seed, args.quantization, args.attention_backend,
                         args.moe_runner_backend, None if args.index_key_dtype == "auto" else args.index_key_dtype,
                         draft=engine.speculative is not None, fp8_gemm_backend=args.fp8_gemm_backend,
                         ep_num_redundant_experts=args.ep_num_redundant_experts,
                         init_expert_location=args.init_expert_location,
                         ep_dispatch_algorithm=args.ep_dispatch_algorithm,
                         deterministic=args.enable_deterministic_inference, dcp_size=args.dcp_size)
    check_dcp_flags(args.dcp_size, layout, engine)
    if args.enable_deterministic_inference and (why := deterministic_conflict(
            args.attention_backend, args.moe_runner_backend, args.fp8_gemm_backend)):
        raise UserError(why)
    if args.enable_deterministic_inference:
        check_deterministic_model(path, args.quantization)
    check_expert_location_flags(layout, args.ep_num_redundant_experts, args.init_expert_location)
    try:
        check_recorder_mode(args.expert_distribution_recorder_mode)
        check_dispatch_flags(args.ep_dispatch_algorithm, args.ep_num_redundant_experts, args.init_expert_location)
        engine.eplb = eplb_config(args.enable_eplb, args.eplb_rebalance_num_iterations,
                                  args.eplb_rebalance_layers_per_chunk, layout.moe, args.ep_num_redundant_experts)
    except RecorderError as e:
        raise UserError(str(e).rstrip(".")) from None
    if engine.speculative is not None:  # before anything loads: the MTP layer is there, the options go with it
        try:
            check_speculative(engine)
            check_mtp_checkpoint(path)
        except ValueError as e:
            raise UserError(f"--speculative-algorithm {engine.speculative.algorithm}: {e}") from None
    name = args.served_model_name or (Path(path).name if Path(path).is_dir() else path)
    http = HttpOptions(args.host, args.port, args.api_key, name, args.log_level, args.decode_log_interval)
    flags = {k: v for k, v in vars(args).items() if k not in ("api_key", "engine_child")} | {"model_path": path}
    return ServeConfig(model, engine, pool_sizing(args, engine.page_size, layout.replicas), limits, layout, dist, http,
                       tokenizer, args.compilation_cache_dir, engine_process, flags, tool_parser, thinking_parser)


def check_deterministic_model(path: str, quantization: str | None) -> None:
    """--enable-deterministic-inference refused in one sentence for a model whose products fall back to XLA's
    shape-dependent forms (`deterministic_model_refusal`), read from its config.json before any weight loads."""
    try:
        cfg, nvfp4 = model_config(path), bool(Path(path).is_dir() and read_quant_config(path))
    except UnsupportedConfigError:
        return  # the loader refuses the checkpoint itself, in its own sentence
    if why := deterministic_model_refusal(cfg, quantization, nvfp4):
        raise UserError(why)


def check_dcp_flags(dcp: int, layout: Layout, engine) -> None:
    """--dcp-size, refused in one sentence where the layout, the page size or another flag cannot take it."""
    try:
        check_dcp_pool(dcp, layout.tp, engine.pool_page_size)
    except DCPError as e:
        raise UserError(str(e).rstrip(".")) from None
    if dcp > 1 and engine.speculative is not None:
        raise UserError(f"--dcp-size {dcp} is not built with --speculative-algorithm yet; drop one of them")


def pool_pages(sizing: PoolSizing, runner, replica: int) -> int:
    """KV pages per rank for one replica (see the module docstring)."""
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
