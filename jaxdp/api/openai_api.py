"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Supported: `max_tokens` (chat: also `max_completion_tokens`; default 16 for completions, the rest of the
context for chat), `temperature`, `top_p`, `seed`, `stop`, `n`, `logprobs`, `stream` with
`stream_options.include_usage` (a last chunk with `usage` and empty `choices`), and SGLang's extras
`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `routed_dp_rank`. Completions take a prompt as text,
token ids, or a batch of either. Without a tokenizer the text fields are empty and each choice carries
`token_ids`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from jaxdp.api.app import Job, ServerContext, complete_jobs, job_error, run_jobs
from jaxdp.api.common import (
    ApiError,
    check_n,
    done_ids,
    field,
    finish_reason,
    openai_finish,
    read_json,
    sampling_params,
    sse,
)
from jaxdp.api.native import pinned_rank

router = APIRouter()


@router.get("/v1/models")
async def models(http: HttpRequest):
    ctx: ServerContext = http.app.state.ctx
    return {"object": "list", "data": [{"id": ctx.served_model_name, "object": "model", "created": ctx.created,
                                        "owned_by": "jaxdp", "root": ctx.model_path,
                                        "max_model_len": ctx.context_len(None)}]}


def _params(body: dict, default_max: int | None):
    max_tokens = field(body, "max_tokens", int)
    if max_tokens is None:
        max_tokens = field(body, "max_completion_tokens", int, default_max)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    sp = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                               "ignore_eos") if body.get(k) is not None}
    sp["max_new_tokens"] = max_tokens
    params = sampling_params(sp, max_new=None)
    params.max_new_tokens = max_tokens
    return params


def _completion_prompts(ctx: ServerContext, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.encode(prompt, "a text prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [ctx.encode(p, "a text prompt") for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return prompt
    if prompt is None:
        raise ApiError("prompt is required: a string, a list of strings, token ids, or a list of token id lists",
                       param="prompt")
    raise ApiError("prompt must be a string, a list of strings, token ids, or a list of token id lists; "
                   "an empty prompt is not allowed", param="prompt")


def _chat_prompt(ctx: ServerContext, messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages is required: a non-empty list of {role, content} objects", param="messages")
    flat = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("each message must be an object with a role and a content", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content):
                raise ApiError("this server reads text message parts only", param="messages")
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError("a message's content must be a string or a list of text parts", param="messages")
        flat.append({"role": m["role"], "content": content})
    if ctx.tokenizer is None:
        ctx.encode("", "chat messages")  # raises: no tokenizer
    try:
        text = ctx.tokenizer.apply_chat_template(flat, add_generation_prompt=True)
    except Exception as e:  # a template that refuses the conversation (jinja2 raise_exception, no template)
        raise ApiError(f"the chat template refused these messages: {e}", param="messages") from None
    return ctx.tokenizer.encode(text)


def _logprobs_completion(ctx: ServerContext, job: Job) -> dict:
    tok, req = ctx.tokenizer, job.req
    tokens = [tok.decode([t], skip_special_tokens=False) if tok else str(t) for t in done_ids(req)]
    lps = list(req.output_logprobs)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps,
                                                                                                 strict=False)],
            "text_offset": None}


def _logprobs_chat(ctx: ServerContext, job: Job, start: int = 0) -> dict:
    tok, req = ctx.tokenizer, job.req
    content = []
    for t, lp in list(zip(done_ids(req), req.output_logprobs, strict=False))[start:]:
        text = tok.decode([t], skip_special_tokens=False) if tok else str(t)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return {"content": content}


def _matched_stop(job: Job) -> str | int | None:
    """SGLang's matched_stop: the stop string, or the stop token id (EOS included) that ended the choice."""
    reason = finish_reason(job.req, job.view)
    return reason.get("matched") if reason else None


def _usage(jobs: list[Job]) -> dict:
    firsts = {}
    for job in jobs:
        firsts.setdefault(job.prompt_index, job.req)
    prompt = sum(len(r.prompt_ids) for r in firsts.values())
    completion = sum(len(done_ids(j.req)) for j in jobs)
    cached = sum(r.cached_tokens for r in firsts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _handle(http: HttpRequest, chat: bool):
    ctx: ServerContext = http.app.state.ctx
    body = await read_json(http)
    if chat:
        prompts = [_chat_prompt(ctx, body.get("messages"))]
    else:
        prompts = _completion_prompts(ctx, body.get("prompt"))
        if field(body, "echo", bool, False):
            raise ApiError("echo is not supported; leave it false", param="echo")
    params = _params(body, None if chat else 16)
    logprobs = body.get("logprobs")
    want_logprobs = bool(logprobs) if chat else logprobs is not None
    if not chat and logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                              or not 0 <= logprobs <= 5):
        raise ApiError("logprobs must be an integer from 0 to 5", param="logprobs")
    params.return_logprob = want_logprobs
    n = check_n(body.get("n", 1))
    jobs = ctx.make_jobs(prompts, [params] * len(prompts), n, rank=pinned_rank(body, http))
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if field(body, "stream", bool, False):
        options = field(body, "stream_options", dict, {}) or {}
        usage = bool(options.get("include_usage", False))
        return StreamingResponse(_stream(ctx, jobs, cid, chat, want_logprobs, usage), media_type="text/event-stream")
    await complete_jobs(http, ctx.backend, jobs)
    choices = []
    for i, job in enumerate(jobs):
        text, req = job.view.text(job.req), job.req
        choice: dict[str, Any] = {"index": i, "finish_reason": openai_finish(req), "matched_stop": _matched_stop(job)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = _logprobs_chat(ctx, job) if want_logprobs else None
        else:
            choice["text"] = text
            choice["logprobs"] = _logprobs_completion(ctx, job) if want_logprobs else None
        if ctx.tokenizer is None:
            choice["token_ids"] = done_ids(req)
        choices.append(choice)
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": ctx.served_model_name, "choices": choices, "usage": _usage(jobs)}


async def _stream(ctx: ServerContext, jobs: list[Job], cid: str, chat: bool, want_logprobs: bool, usage: bool):
    kind = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    sent_text = [""] * len(jobs)
    sent_tokens = [0] * len(jobs)

    def chunk(choices: list[dict], **extra) -> str:
        return sse({"id": cid, "object": kind, "created": created, "model": ctx.served_model_name,
                    "choices": choices, **({"usage": None} if usage else {}), **extra})

    if chat:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(jobs))])
    async for i in run_jobs(ctx.backend, jobs):
        job = jobs[i]
        if (err := job_error(job)) is not None:
            yield sse({"error": {"message": err.message, "type": err.kind, "code": err.status}})
            continue
        text, req = job.view.text(job.req), job.req
        delta = text[len(sent_text[i]):] if text.startswith(sent_text[i]) else ""
        finish = openai_finish(req)
        if not delta and finish is None and ctx.tokenizer is not None:
            continue
        sent_text[i] += delta
        choice: dict[str, Any] = {"index": i, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": delta} if delta or finish is None else {}
            choice["logprobs"] = _logprobs_chat(ctx, job, sent_tokens[i]) if want_logprobs else None
        else:
            choice["text"] = delta
            choice["logprobs"] = None
        if ctx.tokenizer is None:
            choice["token_ids"] = done_ids(req)[sent_tokens[i]:]
        if finish is not None:
            choice["matched_stop"] = _matched_stop(job)
        sent_tokens[i] = len(done_ids(req))
        yield chunk([choice])
    if usage:
        yield chunk([], usage=_usage(jobs))
    yield sse("[DONE]")


@router.post("/v1/completions")
async def completions(http: HttpRequest):
    return await _handle(http, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(http: HttpRequest):
    return await _handle(http, chat=True)
