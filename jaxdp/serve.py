"""`python -m jaxdp.serve`: the OpenAI-compatible and SGLang-native HTTP server (FastAPI + uvicorn).

Its flags, with examples, are in `jaxdp.serve_flags` (`python -m jaxdp.serve --help`); `jaxdp.serve_config` checks
them into one `ServeConfig`. Here: the start-up (tokenizer, engines in a process of their own or in this one, the
nodes of a multi-node model) and the HTTP server. User errors (bad flags, a model that does not fit, a port in use)
end in one line `error: ...` and exit status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import jax
import uvicorn

from jaxdp.api.app import create_app
from jaxdp.api.context import ChatParsing
from jaxdp.api.draining import DrainingServer
from jaxdp.api.metrics import ServerMetrics
from jaxdp.api.monitor import Monitor, RankFormatter
from jaxdp.api.replicas import ReplicaSet
from jaxdp.engine.ipc.messages import WireError
from jaxdp.engine.ipc.process import ServerWatch, read_start, serve_engines
from jaxdp.engine.ipc.remote import EngineProcess, EngineProcessError
from jaxdp.engine.loop import Engine
from jaxdp.engine.nodes.hosts import (
    DistError,
    HostExchange,
    init_distributed,
    local_device_count,
    parse_dist_addr,
    world_devices,
)
from jaxdp.engine.nodes.supervise import NODE_CHILD_ENV, exit_now, supervise_node
from jaxdp.engine.setup import build_runners, enable_compilation_cache
from jaxdp.grammar import Grammars, vocabulary
from jaxdp.layout import LayoutError, check_memory_balance, device_free_memory, ensure_host_devices
from jaxdp.node import serve_node
from jaxdp.ops.platform import keep_freed_host_memory
from jaxdp.parallel.tbo import set_xla_flags as set_tbo_xla_flags
from jaxdp.serve_config import (  # noqa: F401  (the flags' checks, re-exported where callers look for them)
    ServeConfig,
    UserError,
    engine_config,
    pool_pages,
    serve_config,
    server_limits,
)
from jaxdp.serve_flags import build_parser  # noqa: F401  (re-exported: callers import it from here)
from jaxdp.tokenizer import Tokenizer

log = logging.getLogger("jaxdp.serve")

ENGINE_CHILD = ["-m", "jaxdp.serve", "--engine-child"]  # how the server starts its engine process
START_ERRORS = (LayoutError, UserError, DistError, ValueError, FileNotFoundError)  # the user's to fix: one line


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(RankFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for noisy in ("jax._src.xla_bridge", "jax._src.compiler", "jax._src.cache_key"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """A start-up error the user must fix (a flag, a port in use, a model that does not fit in device memory) ends
    this process with one line `error: ...` and exit status 2, never a traceback."""
    try:
        yield
    except START_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:  # out of device memory while loading: the model does not fit
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            print(f"error: the model does not fit in device memory ({str(e).splitlines()[0][:200]}); use more "
                  "devices (--tp-size), a smaller --mem-fraction-static or --max-total-tokens", file=sys.stderr)
            raise SystemExit(2) from None
        raise


def load_tokenizer(config: ServeConfig) -> Tokenizer | None:
    """The tokenizer the config names; None with --skip-tokenizer-init, or where there is none (token ids only)."""
    path = config.tokenizer_path
    if path is None:
        return None
    tokenizer = Tokenizer.from_dir(path) if Path(path).is_dir() else None
    if tokenizer is None:
        log.warning("%s has no tokenizer: serving token ids only (text requests get a 400)", path)
    return tokenizer


def with_readable_grammars(config: ServeConfig, tokenizer: Tokenizer | None) -> ServeConfig:
    """The config with no grammar backend where its library cannot read the model's tokenizer: the server still
    serves, without structured outputs (their requests get a 400), and says why once in its log."""
    vocab = vocabulary(tokenizer, tokenizer.tok.get_vocab_size()) if tokenizer is not None else None
    problem = Grammars.reading_problem(config.engine.grammar_backend, vocab)
    if problem is None:
        return config
    log.warning("--grammar-backend %s cannot read this model's tokenizer (%s): serving without structured outputs "
                "(response_format, json_schema, regex and ebnf requests get a 400); --grammar-backend xgrammar may "
                "read it", config.engine.grammar_backend, problem)
    return dataclasses.replace(config, engine=dataclasses.replace(config.engine, grammar_backend="none"))


def start_xla_flags(config: ServeConfig, environ=os.environ, platform: str | None = None) -> None:
    """The XLA_FLAGS the engines need, set before JAX's backends start (when XLA reads them): with two-batch
    overlap on a GPU, XLA:GPU's latency-hiding scheduler (analytical estimator) and no combining of collectives
    (`jaxdp.parallel.tbo.xla_flags`; a flag the user set keeps the user's value). platform: JAX's, predicted
    (`jaxdp.parallel.tbo.platform_at_start`) unless given."""
    if config.engine.tbo_threshold is not None:
        before = environ.get("XLA_FLAGS", "")
        if (after := set_tbo_xla_flags(environ, platform)) != before:
            log.info("two-batch overlap on a GPU: XLA_FLAGS=%s", after)


def start_engines(config: ServeConfig) -> tuple[ReplicaSet, Tokenizer | None]:
    """In the process that owns the devices (the engine process, a server without one, a node > 0): set the XLA
    flags the engines need, join the model world or ask for the host devices the mesh needs before JAX's
    backends start, then build the engines."""
    layout, dist = config.layout, config.dist
    start_xla_flags(config)
    if dist.multi:
        ensure_host_devices(local_device_count(layout.world, dist.nnodes, layout.tp))
        init_distributed(dist)  # before anything else starts JAX's backends
    else:
        ensure_host_devices(layout.total_devices)  # CPU: the host devices the mesh asks for, before JAX starts
    enable_compilation_cache(config.compilation_cache_dir)  # '' leaves it off
    keep_freed_host_memory()  # a CPU's steps reuse their temporaries' pages
    layout.validate(len(jax.devices()))
    tokenizer = load_tokenizer(config)
    return build_backend(with_readable_grammars(config, tokenizer), tokenizer), tokenizer


def build_backend(config: ServeConfig, tokenizer) -> ReplicaSet:
    """Load the model once, then one StepRunner + Engine per replica on its own contiguous sub-mesh."""
    layout, dist = config.layout, config.dist
    devices = world_devices(layout.world, dist.nnodes) if dist.multi else jax.devices()
    if dist.multi:  # each node checks the balance of its own devices
        here = [d for d in devices if d.process_index == jax.process_index()]
        if (free := device_free_memory(here)) is not None:
            check_memory_balance(free, [[str(d) for d in here]])
    else:
        layout.check_memory(devices[: layout.total_devices])
    meshes = layout.replica_meshes(devices) if layout.replicas > 1 else [layout.make_mesh(devices[: layout.world])]
    one = dataclasses.replace(layout, replicas=1)
    t0 = time.perf_counter()
    runners = build_runners(config.model, one, meshes, num_pages=1, page_size=config.engine.page_size)
    cfg = runners[0].cfg
    one.validate(n_routed_experts=cfg.n_routed_experts, num_heads=cfg.num_heads)
    log.info("Load weight end. elapsed=%.2f s, model=%s, %d layers, layout %s", time.perf_counter() - t0,
             config.model.path, cfg.num_layers, layout.describe())
    engines = []
    hosts = None
    grammars = Grammars.create(config.engine.grammar_backend, vocabulary(tokenizer, cfg.vocab_size))
    if dist.multi:
        hosts = HostExchange(dist.nnodes, dist.node_rank, one.dp, dist.timeout_s, init_timeout_s=dist.init_timeout_s,
                             coordinator_host=parse_dist_addr(dist.addr)[0])
    for r, runner in enumerate(runners):
        runner.resize_pool(pool_pages(config.pool, runner, r))
        for rank in (hosts.local_ranks() if hosts else range(one.dp)):
            where = f"replica {r}" if len(runners) > 1 else f"rank {rank}"
            log.info("KV Cache is allocated (%s). dtype: %s, #tokens: %d, pages: %d x %d", where,
                     jax.numpy.dtype(runner.cache_dtype).name, runner.num_pages * runner.page_size, runner.num_pages,
                     runner.page_size, extra={"dp": r * one.dp + rank})
        engines.append(Engine(runner, config=dataclasses.replace(config.engine), tokenizer=tokenizer, hosts=hosts,
                              grammars=grammars))
    return ReplicaSet(engines, config.engine.load_balance_method)


def main(argv: list[str] | None = None) -> int:
    """Parse the flags once into a ServeConfig and run this process's role: the server (`run_server`: node 0, or
    the only node), a node > 0 (`run_node`, under a supervising parent that `supervise_node` is), or the server's
    engine process (`run_engine_child`, started with --engine-child: its config comes on stdin, not as flags)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.engine_child:
        return run_engine_child(sys.stdin.buffer)
    if args.nnodes > 1 and args.node_rank > 0 and not os.environ.get(NODE_CHILD_ENV):
        return supervise_node(["-m", "jaxdp.serve", *argv], args.node_rank)  # the node runs as its child
    setup_logging(args.log_level)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    with one_line_errors():
        config = serve_config(args)
    if config.dist.multi and config.dist.node_rank > 0:
        return run_node(config)
    return run_server(config)


def run_server(config: ServeConfig) -> int:
    """Node 0, or the only node: the engines (in a process of their own unless --no-engine-process or several
    nodes) behind the HTTP API, until SIGTERM."""
    with one_line_errors():
        check_port(config.http.host, config.http.port)
        config = with_readable_grammars(config, load_tokenizer(config))
        if config.engine_process:  # the devices are the child's: JAX starts there, not here
            tokenizer = load_tokenizer(config)
            backend = start_engine_process(config, tokenizer)
        else:
            backend, tokenizer = start_engines(config)
    code = serve_http(config, backend, tokenizer)
    if config.dist.multi:  # do not wait in JAX's shutdown barrier for nodes that may be gone already
        time.sleep(1.0)  # the other nodes passed the "stopped" barrier; let them exit before the runtime goes
        exit_now(code)
    return code


def run_node(config: ServeConfig) -> int:
    """A node other than 0: its ranks' loop and /health (`jaxdp.node`)."""
    with one_line_errors():
        check_port(config.http.host, config.http.port)
        backend, _ = start_engines(config)
    return serve_node(config, backend.engines[0])


def run_engine_child(stdin: BinaryIO) -> int:
    """The server's engine process (`jaxdp.engine.ipc.process`): reads its `EngineStart` (the server's checked
    config, its sockets) from `stdin`, builds the engines as the server would, and runs them for the server. From
    its first moment it ends once the server's process is gone (`ServerWatch`), start-up included."""
    watch = ServerWatch.from_env().start()
    try:
        start = read_start(stdin, ServeConfig)
    except WireError as e:
        print(f"error: the engine process got no start message from the server ({e}); --engine-child is for the "
              "server's own use: run python -m jaxdp.serve without it", file=sys.stderr)
        return 2
    config = start.config
    setup_logging(config.http.log_level)
    watch.expect(start.parent)
    faulthandler.register(signal.SIGUSR1)
    with one_line_errors():
        backend, _ = start_engines(config)
    return serve_engines(backend.engines, start.commands, start.events, watch)


def start_engine_process(config: ServeConfig, tokenizer) -> ReplicaSet:
    """A child (`run_engine_child`) builds and runs the engines from `config`; this process serves HTTP over them.
    Exits with the child's status if it fails to start (it said why, in one sentence), and with 0 on SIGTERM while
    the child starts (an operator's stop; the child is killed and waited for, none is left behind)."""
    def stop_starting(_sig, _frame) -> None:
        log.info("SIGTERM during start-up: the engine process is stopped and the server exits")
        raise SystemExit(0)

    before = signal.signal(signal.SIGTERM, stop_starting)  # (the HTTP server installs its own once it runs)
    try:
        return ReplicaSet(EngineProcess(ENGINE_CHILD, config, tokenizer).engines, config.engine.load_balance_method)
    except EngineProcessError as e:
        raise SystemExit(e.code) from None
    finally:
        signal.signal(signal.SIGTERM, before)


def serve_http(config: ServeConfig, backend: ReplicaSet, tokenizer) -> int:
    """The HTTP API over `backend` until SIGTERM (then a graceful drain)."""
    http, layout = config.http, config.layout
    server_args = {**config.flags, "layout": layout.describe(), "mesh": layout.spec(),
                   "context_length": backend.context_len(), "num_pages": [e.facts.num_pages for e in backend.engines]}
    metrics = ServerMetrics(backend, http.served_model_name)
    monitor = Monitor(backend, metrics, decode_log_interval=http.decode_log_interval)
    app = create_app(backend, tokenizer=tokenizer, served_model_name=http.served_model_name,
                     model_path=config.model.path, server_args=server_args, api_key=http.api_key, metrics=metrics,
                     limits=config.limits, bind=(http.host, http.port),
                     parsing=ChatParsing(config.tool_call_parser, config.reasoning_parser),
                     grammars=Grammars.create(config.engine.grammar_backend,
                                              vocabulary(tokenizer, backend.model_cfg.vocab_size)))
    backend.start()
    monitor.start()
    uvicorn_config = uvicorn.Config(app, host=http.host, port=http.port, log_config=None, access_log=False,
                                    log_level=http.log_level, timeout_graceful_shutdown=5, loop="uvloop",
                                    http="httptools")
    server = DrainingServer(uvicorn_config, app.state.ctx)

    def announce():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            log.info("The server is fired up and ready to roll! http://%s:%d (%d ranks)", http.host, http.port,
                     backend.num_ranks)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run()
    finally:
        monitor.stop()
        backend.shutdown()
    log.info("shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
