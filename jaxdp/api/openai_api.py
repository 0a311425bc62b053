"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Supported: `max_tokens` (chat: also `max_completion_tokens`; default 16 for completions, the rest of the
context for chat), `temperature`, `top_p`, `seed`, `stop`, `n`, `logprobs`, completions' `echo` (the prompt's
tokens and logprobs first; `max_tokens: 0` with it) and vLLM's `prompt_logprobs` (chat: at the top of the answer),
`stream` with `stream_options.include_usage` (a last chunk with `usage` and empty `choices`), and SGLang's extras
`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `routed_dp_rank`. Completions take a prompt as text,
token ids, or a batch of either. Without a tokenizer the text fields are empty and each choice carries
`token_ids`. Every other field of OpenAI's schemas is in the field table (`jaxdp.api.field_table`, docs/api.md):
accepted without effect (`user`, `metadata`, ...), or refused unless neutral (`response_format`, `logit_bias`, the
penalties, ...).

Chat tools and reasoning (docs/api.md): `tools`, assistant messages' `tool_calls`, `role: "tool"` messages and
`chat_template_kwargs` go to the checkpoint's chat template. With `--tool-call-parser` and tools in the request, the
output's calls become `message.tool_calls` (stream: `delta.tool_calls`) and `finish_reason: "tool_calls"`; with
`--reasoning-parser`, the reasoning becomes `reasoning_content` (unless `separate_reasoning: false`);
`jaxdp.api.chat_output` reads both.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest

from jaxdp.api.chat_output import ChatOutput, ChoiceReader, chat_message, chat_output
from jaxdp.api.common import ApiError, done_ids, finish_reason, openai_finish, sse
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
from jaxdp.api.field_table import REFUSED_ROLES
from jaxdp.api.fields import (
    MAX_PROMPTS,
    REQUEST,
    SAMPLING,
    check_n,
    echo_max_tokens,
    field,
    prompt_logprobs_field,
    sampling_params,
    token_ids,
)
from jaxdp.api.logprobs import completion_logprobs, token_text, vllm_prompt_logprobs
from jaxdp.api.structured import checked, openai_grammar
from jaxdp.engine.sched.request import with_controls

router = APIRouter()


@router.get("/v1/models")
async def models(http: HttpRequest):
    ctx: ServerContext = http.app.state.ctx
    return {"object": "list", "data": [{"id": ctx.served_model_name, "object": "model", "created": ctx.created,
                                        "owned_by": "jaxdp", "root": ctx.model_path,
                                        "max_model_len": ctx.context_len(None)}]}


def _params(ctx: ServerContext, body: dict, default_max: int | None, echo: bool = False):
    """SamplingParams from the body; max_tokens 0 (allowed with echo, as vLLM) reads the prompt and generates
    one token that is not shown."""
    max_tokens = echo_max_tokens(body) if echo else SAMPLING["max_new_tokens"].check(body, "max_tokens", None)
    if max_tokens == 0:
        max_tokens = 1
    if max_tokens is None:
        max_tokens = SAMPLING["max_new_tokens"].check(body, "max_completion_tokens", default_max, param="max_tokens")
    sp = {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                               "ignore_eos") if body.get(k) is not None}
    for name in ("no_stop_trim", "include_stop_str_in_output"):  # (SGLang's name; vLLM's)
        if body.get(name) is not None:
            sp["no_stop_trim"] = sp.get("no_stop_trim", False) or field(body, name, bool)
    for name in ("min_tokens", "min_new_tokens"):  # (vLLM's name on its OpenAI endpoints; SGLang's)
        if body.get(name) is not None:
            sp["min_new_tokens"] = SAMPLING["min_new_tokens"].check(body, name, 0)
    params = with_controls(sampling_params(sp, max_new=None, vocab_size=ctx.vocab_size), body)  # (penalties, bias)
    params.max_new_tokens = max_tokens
    return params


async def _completion_prompts(ctx: ServerContext, prompt: Any, rank: int | None) -> list[list[int]]:
    if isinstance(prompt, str):
        return await ctx.encode([prompt], "a text prompt", rank)
    if isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS and not all(isinstance(t, int) for t in prompt):
            raise ApiError(f"prompt holds {len(prompt)} prompts, more than the {MAX_PROMPTS} allowed; split it",
                           param="prompt")
        context = ctx.context_len(rank)
        if all(isinstance(p, str) for p in prompt):
            return await ctx.encode(prompt, "a text prompt", rank)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [token_ids(prompt, "prompt", ctx.vocab_size, context)]
        if all(isinstance(p, list) for p in prompt):
            return [token_ids(p, "prompt", ctx.vocab_size, context) for p in prompt]
    if prompt is None:
        raise ApiError("prompt is required: a string, a list of strings, token ids, or a list of token id lists",
                       param="prompt")
    raise ApiError("prompt must be a string, a list of strings, token ids, or a list of token id lists; "
                   "an empty prompt is not allowed", param="prompt")


async def chat_prompt(ctx: ServerContext, messages: Any, rank: int | None, *,
                      tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The prompt tokens of a conversation: each message checked and handed to the chat template (role, content,
    name, an assistant's tool_calls, a tool message's tool_call_id), with the request's tools and template
    keyword arguments."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages is required: a non-empty list of {role, content} objects", param="messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError("each message must be an object with a role and a content", param="messages")
        if m["role"] in REFUSED_ROLES:
            raise ApiError(f"messages[{i}] has role {m['role']!r}, OpenAI's deprecated form of tool results, which "
                           'this server does not read; send role "tool" with the tool_call_id instead',
                           param="messages")
        checked_fields(ctx, m, "messages[]", where=f"messages[{i}].")
        name = field(m, "name", str, where=f"messages[{i}].")
        calls = _message_tool_calls(m, i)
        call_id = field(m, "tool_call_id", str, where=f"messages[{i}].")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise ApiError("this server reads text message parts only", param="messages")
            content = "".join(parts)
        if content is None and calls:
            content = ""  # (SGLang's: a template may add the content to a string)
        if not isinstance(content, str):
            raise ApiError("a message's content must be a string or a list of text parts", param="messages")
        flat.append({"role": m["role"], "content": content} | ({"name": name} if name else {})
                    | ({"tool_calls": calls} if calls else {}) | ({"tool_call_id": call_id} if call_id else {}))
    return await ctx.encode_chat(flat, rank, tools=tools, template_kwargs=template_kwargs)


def _message_tool_calls(message: dict, i: int) -> list[dict[str, Any]] | None:
    """An assistant message's tool_calls, checked, in OpenAI's shape (arguments as sent: JSON text, or an object)."""
    where = f"messages[{i}].tool_calls"
    calls = field(message, "tool_calls", list, where=f"messages[{i}].")
    if not calls:
        return None
    if message["role"] != "assistant":
        raise ApiError(f"{where} belongs to an assistant message, not a {message['role']!r} one", param="messages")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]
                or not isinstance(function.get("arguments", ""), str | dict)
                or not isinstance(call.get("id", ""), str) or call.get("type", "function") != "function"):
            raise ApiError(f'{where}[{k}] must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                           '"arguments": "<JSON text>"}}', param="messages")
        out.append(({"id": call["id"]} if call.get("id") else {})
                   | {"type": "function", "function": {"name": function["name"],
                                                       "arguments": function.get("arguments", "")}})
    return out


def output_text(ctx: ServerContext, job: Job) -> str:
    """The choice's text as the client sees it. Where it is read with special tokens (a request with tools), the
    stop token that ended it is left out."""
    text, req, view = job.view.text(job.req), job.req, job.view
    if view.skip or not req.finished or req.finish_reason != "stop" or view.matched is not None or not view.trim:
        return text
    ids = done_ids(req)
    tail = ctx.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ids and ctx.tokenizer else ""
    return text[: len(text) - len(tail)] if tail and text.endswith(tail) else text


def chat_finish(reader: ChoiceReader, job: Job) -> tuple[str | None, str | int | None]:
    """finish_reason and matched_stop: "tool_calls" (and no matched stop) when a choice that stopped made calls."""
    finish = openai_finish(job.req)
    if finish == "stop" and reader.calls:
        return "tool_calls", None
    return finish, _matched_stop(job)


def _logprobs_chat(ctx: ServerContext, job: Job, start: int = 0, k: int | None = None) -> dict:
    """k: the alternatives asked for (the request's own may be more, when prompt_logprobs asks for more)."""
    req = job.req
    ids = done_ids(req)
    tops = req.output_top_logprobs if req.params.top_logprobs else [[] for _ in ids]
    content = []
    for t, lp, alts in list(zip(ids, req.output_logprobs, tops, strict=False))[start:]:
        alts = alts[:k] if k is not None else alts
        text = token_text(ctx.tokenizer, t)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (a := token_text(ctx.tokenizer, tid)), "logprob": alp,
                                          "bytes": list(a.encode())} for tid, alp in alts]})
    return {"content": content}


def _matched_stop(job: Job) -> str | int | None:
    """SGLang's matched_stop: the stop string, or the stop token id (EOS included) that ended the choice."""
    reason = finish_reason(job.req, job.view)
    return reason.get("matched") if reason else None


def _usage(jobs: list[Job], hide_output: bool = False) -> dict:
    firsts = {}
    for job in jobs:
        firsts.setdefault(job.prompt_index, job.req)
    prompt = sum(len(r.prompt_ids) for r in firsts.values())
    completion = 0 if hide_output else sum(len(done_ids(j.req)) for j in jobs)
    cached = sum(r.cached_tokens for r in firsts.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _handle(http: HttpRequest, chat: bool):
    ctx: ServerContext = http.app.state.ctx
    body = await read_json(http)
    checked_fields(ctx, body, "/v1/chat/completions" if chat else "/v1/completions")
    echo = not chat and field(body, "echo", bool, False)
    rank = pinned_rank(body, http)
    params = _params(ctx, body, None if chat else 16, echo)
    hide_output = echo and body.get("max_tokens") == 0
    if chat:
        want_logprobs = field(body, "logprobs", bool, False)
        top = REQUEST["top_logprobs"].check(body, "top_logprobs", 0)
        if top and not want_logprobs:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        top = REQUEST["logprobs"].check(body, "logprobs", None)
        want_logprobs = top is not None
    params.return_logprob, params.top_logprobs = want_logprobs, top or 0
    stream = field(body, "stream", bool, False)
    prompt_top = prompt_logprobs_field(body, stream)
    if (echo and want_logprobs) or prompt_top is not None:  # the prompt's logprobs, from its first token
        params.logprob_start_len, params.top_logprobs = 0, max(params.top_logprobs, prompt_top or 0)
    if echo and stream:
        raise ApiError("echo is not supported with stream: true; send stream: false to get the prompt back",
                       param="echo")
    usage = field(field(body, "stream_options", dict, {}), "include_usage", bool, False, where="stream_options.")
    output = chat_output(ctx, body) if chat else None
    source, grammar = openai_grammar(body, output.forced_calls if output is not None else None)
    params.grammar = await checked(ctx.grammars, grammar, source)
    if output is not None:
        prompts = [await chat_prompt(ctx, body.get("messages"), rank, tools=output.tools,
                                     template_kwargs=output.template_kwargs)]
    else:
        prompts = await _completion_prompts(ctx, body.get("prompt"), rank)
    n = check_n(body, len(prompts))
    if prompt_top is not None and n > 1:
        raise ApiError("prompt_logprobs needs n: 1 (the prompt's logprobs are the same for every choice)",
                       param="prompt_logprobs")
    # with tools the text keeps its special tokens (SGLang's rule: DeepSeek's and Kimi's call markers are special)
    with_tools = output is not None and output.tools is not None
    jobs = ctx.make_jobs(prompts, [params] * len(prompts), n, rank=rank, bootstraps=bootstraps(body, len(prompts)),
                         skip_special_tokens=not with_tools)
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if stream:
        return event_stream(_stream(ctx, jobs, cid, output, want_logprobs, usage))
    await complete_jobs(http, ctx, jobs)
    choices = []
    for i, job in enumerate(jobs):
        text, req = output_text(ctx, job), job.req
        choice: dict[str, Any] = {"index": i, "finish_reason": openai_finish(req), "matched_stop": _matched_stop(job)}
        if output is not None:
            reader = output.reader()
            choice["message"] = chat_message(reader, text)
            choice["finish_reason"], choice["matched_stop"] = chat_finish(reader, job)
            choice["logprobs"] = _logprobs_chat(ctx, job, k=top or 0) if want_logprobs else None
        else:
            if hide_output:
                text = ""
            if echo:
                text = (ctx.tokenizer.decode(req.prompt_ids) if ctx.tokenizer else "") + text
            choice["text"] = text
            choice["logprobs"] = completion_logprobs(ctx.tokenizer, req, top or 0, echo, hide_output) \
                if want_logprobs else None
            if prompt_top is not None:  # (completions: per choice, as vLLM)
                choice["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokenizer, req, prompt_top)
        if ctx.tokenizer is None:
            choice["token_ids"] = [] if hide_output else done_ids(req)
        choices.append(choice)
    out = {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
           "model": ctx.served_model_name, "choices": choices, "usage": _usage(jobs, hide_output)}
    if chat and prompt_top is not None:  # vLLM puts a chat's at the top (one prompt, n = 1)
        out["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokenizer, jobs[0].req, prompt_top)
    return out


async def _stream(ctx: ServerContext, jobs: list[Job], cid: str, output: ChatOutput | None, want_logprobs: bool,
                  usage: bool):
    """The stream of a chat (`output` given: each choice's text read by its ChoiceReader) or of a completion."""
    chat = output is not None
    kind = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    sent_text = [""] * len(jobs)
    sent_tokens = [0] * len(jobs)
    readers = [output.reader() for _ in jobs] if output is not None else []

    def chunk(choices: list[dict], **extra) -> str:
        return sse({"id": cid, "object": kind, "created": created, "model": ctx.served_model_name,
                    "choices": choices, **({"usage": None} if usage else {}), **extra})

    if chat:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(jobs))])
    async for i in run_jobs(ctx, jobs):
        job = jobs[i]
        if (err := job_error(job)) is not None:
            yield sse({"error": {"message": err.message, "type": err.kind, "code": err.status}})
            continue
        text, req = output_text(ctx, job), job.req
        delta = text[len(sent_text[i]):] if text.startswith(sent_text[i]) else ""
        finish = openai_finish(req)
        sent_text[i] += delta
        fields = readers[i].read(delta, final=finish is not None) if chat else {}
        if not (fields if chat else delta) and finish is None and ctx.tokenizer is not None:
            continue
        choice: dict[str, Any] = {"index": i, "finish_reason": finish}
        if chat:
            choice["delta"] = fields
            choice["logprobs"] = _logprobs_chat(ctx, job, sent_tokens[i]) if want_logprobs else None
        else:
            choice["text"] = delta
            choice["logprobs"] = None
        if ctx.tokenizer is None:
            choice["token_ids"] = done_ids(req)[sent_tokens[i]:]
        if finish is not None:
            choice["matched_stop"] = _matched_stop(job)
            if chat:
                choice["finish_reason"], choice["matched_stop"] = chat_finish(readers[i], job)
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
