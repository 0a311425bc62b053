"""A node other than 0 of a server over several nodes (`python -m jaxdp.serve --nnodes N --node-rank K`): its
ranks' loop and a /health endpoint; it ends when node 0 ends (status 0) or when a node fails (status 1)."""

from __future__ import annotations

import logging
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI, Response

from jaxdp.engine.nodes.hosts import PeerFailure
from jaxdp.engine.nodes.supervise import exit_now
from jaxdp.serve_config import ServeConfig

log = logging.getLogger("jaxdp.serve")


def serve_node(config: ServeConfig, engine) -> int:
    """Nodes other than 0: the loop of this node's ranks (`engine`, built from `config`), and /health at
    `config.http`; ends when node 0 ends or a node fails."""
    node_rank, host, port = config.dist.node_rank, config.http.host, config.http.port
    app = FastAPI(title=f"jaxdp node {node_rank}")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_running else 503)

    try:
        engine.start()  # meets the other nodes once every node has compiled its steps
    except PeerFailure as e:
        print(f"error: {e}", file=sys.stderr)
        exit_now(1)
    ranks = engine.local_ranks
    log.info("node %d serves ranks %d-%d; health at http://%s:%d/health", node_rank, ranks.start, ranks.stop - 1,
             host, port)
    http = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, log_level="warning")
    threading.Thread(target=uvicorn.Server(http).run, name="health", daemon=True).start()
    try:
        while engine.is_running:
            time.sleep(0.2)
    except KeyboardInterrupt:
        exit_now(130)
    if engine.nodes.node_0_stopped:
        log.info("node 0 shut down; node %d ends", node_rank)
        try:
            engine.hosts.barrier("stopped", engine.hosts.timeout_s)  # node 0 keeps the runtime up until here
        except PeerFailure:
            pass
        exit_now(0)
    print(f"error: node {node_rank}: {engine.failed or 'the engine loop ended'}", file=sys.stderr)
    exit_now(1)
    return 1
