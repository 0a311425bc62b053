"""SGLang's native endpoints: /generate, /health, /health_generate, /ready, /server_info, /get_load,
/model_info, /flush_cache, /abort_request, /metrics (and the older names /get_server_info and
/get_model_info, which SGLang keeps as deprecated aliases; sglang.bench_serving asks for /server_info and
/model_info).

/generate takes `text` or `input_ids` (one prompt or a batch), `sampling_params`, `stream`, `rid`,
`return_logprob` with `logprob_start_len` (prompt logprobs from that position; -1: none), `top_logprobs_num`
and `token_ids_logprob`, and a rank pin: `routed_dp_rank`, the deprecated `data_parallel_rank`, or the
`X-Data-Parallel-Rank` header. It answers {"text", "output_ids", "meta_info"} (a list for a batch); with
`stream`, one `data:` line per update with the cumulative text and meta_info, then `data: [DONE]`.
/abort_request takes SGLang's body {"rid": "...", "abort_all": false}; the aborted request answers what it
has generated with finish_reason abort. Every field is checked in `jaxdp.api.fields`; what SGLang takes and
jaxdp does not serve (penalties, constrained decoding, images, LoRA, ...) is refused by the field table
(`jaxdp.api.field_table`, docs/api.md), and so is a sampling_params key it does not list.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from jaxdp.api.common import ApiError, done_ids, error_response, finish_reason, sse
from jaxdp.api.context import (
    Job,
    ServerContext,
    bootstraps,
    checked_fields,
    complete_jobs,
    event_stream,
    job_error,
    pinned_rank,
    read_json,
    run_jobs,
)
from jaxdp.api.fields import (
    MAX_PROMPTS,
    check_n,
    field,
    logprob_start_len,
    rids,
    sampling_params,
    token_ids,
    token_ids_logprob,
    top_logprobs_num,
)
from jaxdp.api.logprobs import sglang_meta
from jaxdp.api.structured import checked, sglang_grammar
from jaxdp.engine import BadRequest, SamplingParams
from jaxdp.engine.sched.request import with_controls

log = logging.getLogger("jaxdp.serve")
router = APIRouter()
async def _prompts(ctx: ServerContext, body: dict, rank: int | None) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError("send exactly one of text or input_ids", param="text")
    if text is not None:
        if isinstance(text, str):
            return await ctx.encode([text], rank=rank), False
        if isinstance(text, list) and 0 < len(text) <= MAX_PROMPTS and all(isinstance(t, str) for t in text):
            return await ctx.encode(text, rank=rank), True
        raise ApiError(f"text must be a string or a list of 1 to {MAX_PROMPTS} strings", param="text")
    if isinstance(ids, list) and ids and all(isinstance(t, list) for t in ids):
        batch, is_batch = ids, True
    elif isinstance(ids, list):
        batch, is_batch = [ids], False
    else:
        raise ApiError("input_ids must be a list of token ids or a list of such lists", param="input_ids")
    if len(batch) > MAX_PROMPTS:
        raise ApiError(f"input_ids holds {len(batch)} prompts, more than the {MAX_PROMPTS} allowed; split it",
                       param="input_ids")
    context = ctx.context_len(rank)
    for p in batch:  # the length first: a prompt too long for any rank is refused before its ids are read
        token_ids(p, "input_ids", ctx.vocab_size, context)
    return batch, is_batch


def _params(ctx: ServerContext, body: dict, count: int) -> tuple[list[SamplingParams], int, bool]:
    sp = field(body, "sampling_params", (dict, list), {})
    sps = sp if isinstance(sp, list) else [sp] * count
    if len(sps) != count or not all(isinstance(s, dict) for s in sps):
        raise ApiError("sampling_params must be an object (or one object per prompt)", param="sampling_params")
    for s in sps:
        checked_fields(ctx, s, "sampling_params", where="sampling_params.")
    params = [with_controls(sampling_params(s, max_new=128, vocab_size=ctx.vocab_size, where="sampling_params."), s)
              for s in sps]  # (with_controls: the penalties and logit_bias)
    n = check_n(sps[0], count)
    skip = field(sps[0], "skip_special_tokens", bool, True, where="sampling_params.")
    return params, n, skip


def result(ctx: ServerContext, job: Job, with_logprobs: bool) -> dict[str, Any]:
    req = job.req
    ids = done_ids(req)
    end = req.finished_at if req.finished_at is not None else time.perf_counter()
    meta: dict[str, Any] = {
        "id": req.rid, "finish_reason": finish_reason(req, job.view), "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(ids), "cached_tokens": req.cached_tokens,
        "e2e_latency": end - req.created, "dp_rank": req.dp_rank,
    }
    if req.spec_verify_ct:  # speculative decoding (SGLang's names): verifies, and tokens per verify
        meta |= {"spec_verify_ct": req.spec_verify_ct,
                 "spec_accept_length": (req.spec_accepted + req.spec_verify_ct) / req.spec_verify_ct}
    if with_logprobs:
        meta |= sglang_meta(ctx.tokenizer, req)
    return {"text": job.view.text(req), "output_ids": ids, "meta_info": meta}


@router.post("/generate")
async def generate(http: HttpRequest):
    ctx: ServerContext = http.app.state.ctx
    body = await read_json(http)
    checked_fields(ctx, body, "/generate")
    rank = pinned_rank(body, http)
    stream = field(body, "stream", bool, False)
    with_logprobs = field(body, "return_logprob", bool, False)
    prompts, is_batch = await _prompts(ctx, body, rank)
    params, n, skip = _params(ctx, body, len(prompts))
    sps = body.get("sampling_params") or {}
    for p, sp in zip(params, sps if isinstance(sps, list) else [sps] * len(params), strict=False):
        p.grammar = await checked(ctx.grammars, sglang_grammar(sp, "sampling_params."), "sampling_params")
    start, top = logprob_start_len(body, with_logprobs), top_logprobs_num(body)
    chosen = token_ids_logprob(body, ctx.vocab_size)
    for p in params:
        p.return_logprob, p.logprob_start_len, p.top_logprobs, p.token_ids_logprob = with_logprobs, start, top, chosen
    jobs = ctx.make_jobs(prompts, params, n, rank=rank, rids=rids(body, len(prompts)), skip_special_tokens=skip,
                         bootstraps=bootstraps(body, len(prompts)))
    if stream:
        return event_stream(_stream(ctx, jobs, with_logprobs, is_batch or n > 1))
    await complete_jobs(http, ctx, jobs)
    out = [result(ctx, job, with_logprobs) for job in jobs]
    return JSONResponse(out if is_batch or n > 1 else out[0])


async def _stream(ctx: ServerContext, jobs: list[Job], with_logprobs: bool, indexed: bool):
    async for i in run_jobs(ctx, jobs):
        job = jobs[i]
        if (err := job_error(job)) is not None:
            yield sse({"error": {"message": err.message, "type": err.kind, "code": err.status}})
            continue
        chunk = result(ctx, job, with_logprobs)
        if indexed:
            chunk["index"] = i
        yield sse(chunk)
    yield sse("[DONE]")


@router.get("/health")
async def health(http: HttpRequest):
    ok = http.app.state.ctx.backend.alive()
    return Response(status_code=200 if ok else 503)


@router.get("/health_generate")
async def health_generate(http: HttpRequest):
    """Healthy when a one-token generation completes within 20 s (SGLang's check). A server in a disaggregation
    mode cannot generate alone (its requests need the other server): there it is /health."""
    ctx: ServerContext = http.app.state.ctx
    if ctx.backend.engines[0].cfg.disaggregation is not None:
        return Response(status_code=200 if ctx.backend.alive() else 503)
    try:
        req = ctx.backend.make_request([0], SamplingParams(max_new_tokens=1, temperature=0))
        await asyncio.wait_for(ctx.backend.generate(req), timeout=20)
    except (TimeoutError, BadRequest):
        return error_response("the engine did not produce a token within 20 s", 503, "server_error")
    if req.finish_reason not in ("stop", "length"):
        return error_response(f"the health check request ended with {req.finish_reason}", 503, "server_error")
    return Response(status_code=200)


@router.get("/ready")
async def ready(http: HttpRequest):
    """SGLang's readiness probe: 200 once the server takes requests (here: while the backend is alive)."""
    return Response(status_code=200 if http.app.state.ctx.backend.alive() else 503)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(http: HttpRequest):
    ctx: ServerContext = http.app.state.ctx
    b = ctx.backend
    engines = [{"replica": i, "layout": e.layout.describe(), "mesh": e.layout.spec(),
                "decode_buckets": e.buckets.decode, "extend_buckets": e.buckets.extend,
                "compiles_in_steps": e.stats.compiles_in_steps, "steps": e.stats.steps,
                "step_summary": e.stats.summary()} for i, e in enumerate(b.engines)]
    states = await asyncio.to_thread(b.states)
    info = {**ctx.server_args, "served_model_name": ctx.served_model_name, "num_ranks": b.num_ranks,
            "num_replicas": b.num_replicas, "load_balance_method": b.method, "engines": engines,
            "internal_states": states, "version": "jaxdp-0.1.0"}
    lengths = [s["spec_accept_length"] for s in states if s.get("spec_accept_length")]
    if lengths:  # speculative decoding: SGLang's server-wide figure, the mean over ranks that verified
        info["avg_spec_accept_length"] = sum(lengths) / len(lengths)
    return info


@router.get("/get_load")
async def get_load(http: HttpRequest):
    # off the event loop: with the engine in a process of its own the figures are a round trip away
    states = await asyncio.to_thread(http.app.state.ctx.backend.states)
    return [{k: s[k] for k in ("dp_rank", "num_reqs", "num_running_reqs", "num_queue_reqs", "num_tokens",
                               "token_usage")} | {"num_waiting_reqs": s["num_queue_reqs"]} for s in states]


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(http: HttpRequest):
    """SGLang's model info; sglang.bench_serving reads tokenizer_path (or model_path) when run without
    --tokenizer, so it names the checkpoint directory only when that directory holds the tokenizer."""
    ctx: ServerContext = http.app.state.ctx
    config = _hf_config(ctx.model_path)
    return {"model_path": ctx.model_path, "served_model_name": ctx.served_model_name,
            "tokenizer_path": ctx.model_path if ctx.tokenizer else None, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": config.get("model_type"), "architectures": config.get("architectures")}


def _hf_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's config.json ({} for a preset or a directory without one)."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


@router.post("/flush_cache")
async def flush_cache(http: HttpRequest):
    """Flush the prefix cache of every rank on every node (refused while requests run or wait, as SGLang);
    the answer says, per node, what it did."""
    ctx: ServerContext = http.app.state.ctx
    reports = await asyncio.to_thread(ctx.backend.flush_cache)
    if reports is None:
        raise ApiError("the cache flush did not reach every node (a node failed or did not answer within 30 s); "
                       "check /health and the nodes' logs", 503, "server_error")
    lines = [f"replica {i}, {r.describe()}" if ctx.backend.num_replicas > 1 else r.describe() for i, r in reports]
    if not all(r.flushed for _, r in reports):
        raise ApiError(f"the prefix cache was not flushed everywhere because requests are running or waiting "
                       f"({'; '.join(lines)}); retry when the server is idle")
    return PlainTextResponse("Cache flushed.\n" + "".join(f"{line}\n" for line in lines))


@router.post("/abort_request")
async def abort_request(http: HttpRequest):
    """SGLang's body: {"rid": "...", "abort_all": false}; 200 whether or not such a request was running."""
    ctx: ServerContext = http.app.state.ctx
    body = await read_json(http)
    rid = field(body, "rid", str, "")
    abort_all = field(body, "abort_all", bool, False)
    if not rid and not abort_all:
        raise ApiError("send the rid of the request to abort, or abort_all: true", param="rid")
    count = ctx.abort(None if abort_all else rid)
    log.info("/abort_request aborted %d requests (%s)", count, "all" if abort_all else f"rid {rid[:60]!r}")
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(http: HttpRequest):
    body = await asyncio.to_thread(http.app.state.ctx.metrics.render)  # (reads the ranks' figures: a round trip)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
