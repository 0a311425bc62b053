"""SGLang's expert-distribution endpoints and the balancedness gauge (`--expert-distribution-recorder-mode stat`,
`jaxdp.eplb.recorder`).

- `/start_expert_distribution_record` (GET or POST, no body): every engine starts a recording from zero (a running
  one starts over); answers "Start recording the expert distribution." as SGLang does.
- `/stop_expert_distribution_record`: every engine stops recording (what was recorded stays for a dump).
- `/dump_expert_distribution_record`: the recording so far, as JSON: `logical_count` [MoE layers][experts] (every
  rank's tokens routed to each logical expert, summed over the replicas), `num_steps`, `per_device_logical_count`
  [devices][layers][experts] and, under moe=ep, `balancedness` [layers] (mean / max tokens a device under the
  placement held); several replicas add `replicas`, each one's own. With SGLang's
  `SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR` set, the same JSON is also written there as
  `expert_distribution_recorder_<unix time>.json` (a file `--init-expert-location` reads: its `logical_count`).

Refused in one sentence (HTTP 400): any of them on a server started without the recorder's flag, a dump with
nothing recorded, a model without MoE layers.

On a model spanning several nodes (`--nnodes`) node 0's server serves them: node 0's engine carries the action to
every node in its message of the step exchange, every node starts, stops or dumps between the same two steps, and a
dump holds every device's counts (all nodes'), in the same JSON as on one node (`jaxdp.engine.nodes.link`).

`/metrics` gains `jaxdp:eplb_balancedness{replica, layer}` (moe=ep, while a recording holds counts): each MoE layer's
balancedness over the recording so far, read when Prometheus scrapes (one small read-back per scrape, none per step).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client.core import GaugeMetricFamily

from jaxdp.api.common import ApiError
from jaxdp.api.context import ServerContext
from jaxdp.engine.ipc.client import EngineFailed
from jaxdp.eplb.distribution import ExpertDistribution, RecordOutcome

router = APIRouter()
MODE_FLAG = "expert_distribution_recorder_mode"
DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"


def recording_on(server_args: dict) -> bool:
    """Whether the server was started with the recorder (`--expert-distribution-recorder-mode`, or `--enable-eplb`,
    which records as SGLang's does)."""
    return bool(server_args.get(MODE_FLAG) or server_args.get("enable_eplb"))


def _act(ctx: ServerContext, action: str) -> list[ExpertDistribution | None]:
    """The action on every engine (each replica); refused in one sentence if the server has no recorder or an engine
    refuses."""
    if not recording_on(ctx.server_args):
        raise ApiError("this server records no expert distribution; start it with --expert-distribution-recorder-mode "
                       "stat")
    out: list[RecordOutcome] = [e.expert_record(action) for e in ctx.backend.engines]
    for o in out:
        if o.error is not None:
            raise ApiError(o.error.rstrip("."))
    return [o.distribution for o in out]


@router.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
async def start_expert_distribution_record(http: HttpRequest):
    await asyncio.to_thread(_act, http.app.state.ctx, "start")
    return PlainTextResponse("Start recording the expert distribution.\n")


@router.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
async def stop_expert_distribution_record(http: HttpRequest):
    await asyncio.to_thread(_act, http.app.state.ctx, "stop")
    return PlainTextResponse("Stop recording the expert distribution.\n")


@router.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
async def dump_expert_distribution_record(http: HttpRequest):
    dists = [d for d in await asyncio.to_thread(_act, http.app.state.ctx, "dump") if d is not None]
    body = dists[0].to_json()
    if len(dists) > 1:
        body = {"logical_count": np.sum([d.logical_count for d in dists], axis=0).tolist(),
                "num_steps": max(d.steps for d in dists), "replicas": [d.to_json() for d in dists]}
    if folder := os.environ.get(DIR_ENV):
        path = Path(folder) / f"expert_distribution_recorder_{time.time():.3f}.json"
        try:
            path.write_text(json.dumps(body))
        except OSError as e:
            raise ApiError(f"the dump could not be written to {path} ({e.strerror}); set {DIR_ENV} to a writable "
                           f"folder", 500, "server_error") from None
        body = body | {"path": str(path)}
    return JSONResponse(body)


class BalancednessCollector:
    """`jaxdp:eplb_balancedness{replica, layer}` when Prometheus scrapes: each replica's recording so far (moe=ep)."""

    def __init__(self, backend):
        self.backend = backend

    def collect(self):
        g = GaugeMetricFamily("jaxdp:eplb_balancedness", "Mean over max routed tokens a device, per MoE layer, over "
                              "the expert-distribution recording so far (moe=ep)", labels=["replica", "layer"])
        for i, e in enumerate(self.backend.engines):
            try:
                d = e.expert_record("dump").distribution
            except (EngineFailed, RuntimeError):  # (a failed engine: /health says so; the scrape goes on)
                continue
            if d is not None and d.balancedness is not None:
                for layer, value in enumerate(d.balancedness):
                    g.add_metric([str(i), str(layer)], float(value))
        yield g


def register_expert_metrics(metrics, backend, server_args: dict) -> None:
    """Add the balancedness gauge to `/metrics` (`metrics`: the ServerMetrics) when the server records the expert
    distribution."""
    if recording_on(server_args):
        metrics.registry.register(BalancednessCollector(backend))
