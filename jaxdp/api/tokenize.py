"""The tokenizer over HTTP (vLLM's shapes): /tokenize, /detokenize and /tokenizer_info, which evaluation tools read
to use the server's own tokenizer (lm-evaluation-harness's remote tokenizer: eos, bos, pad, the chat template, the
model's maximum length). /tokenize gives exactly the ids a text prompt of /v1/completions or /generate becomes
(`add_special_tokens`, default true: the BOS the server adds); with `messages`, those of the chat template."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest

from jaxdp.api.common import ApiError
from jaxdp.api.context import ServerContext, read_json
from jaxdp.api.fields import field, int_list
from jaxdp.api.openai_api import chat_prompt

router = APIRouter()


def _tokenizer(ctx: ServerContext):
    if ctx.tokenizer is None:
        raise ApiError("this server has no tokenizer (--skip-tokenizer-init, or the checkpoint has no "
                       "tokenizer.json), so it cannot tokenize; send token ids to the generation endpoints", 404,
                       "not_found_error")
    return ctx.tokenizer


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(http: HttpRequest):
    ctx: ServerContext = http.app.state.ctx
    body = await read_json(http)
    tok = _tokenizer(ctx)
    special = field(body, "add_special_tokens", bool, True)
    messages = body.get("messages")
    if messages is not None:  # the chat template, as /v1/chat/completions renders it
        ids = await chat_prompt(ctx, messages, None)
    else:
        prompt = field(body, "prompt", str)
        if prompt is None:
            raise ApiError("send prompt (a string) or messages to tokenize", param="prompt")
        ctx.check_text_length(len(prompt), "the prompt", None)
        ids = await asyncio.to_thread(tok.encode, prompt, special)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.context_len(None), "tokens": ids}
    if field(body, "return_token_strs", bool, False):
        out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
    return out


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(http: HttpRequest):
    ctx: ServerContext = http.app.state.ctx
    body = await read_json(http)
    tok = _tokenizer(ctx)
    ids = int_list(body.get("tokens"), "tokens", ctx.vocab_size, max_len=ctx.context_len(None))
    skip = field(body, "skip_special_tokens", bool, False)
    return {"prompt": await asyncio.to_thread(tok.decode, ids, skip)}


@router.get("/tokenizer_info")
@router.get("/v1/tokenizer_info")
async def tokenizer_info(http: HttpRequest):
    """The tokenizer's configuration (tokenizer_config.json) with the special tokens, the chat template and the
    maximum length this server serves."""
    ctx: ServerContext = http.app.state.ctx
    tok = _tokenizer(ctx)
    config = {k: v for k, v in getattr(tok, "config", {}).items() if isinstance(v, str | int | float | bool | None)}
    return config | {
        "tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast"),
        "eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token,
        "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id,
        "chat_template": tok.chat_template, "model_max_length": ctx.context_len(None),
        "vocab_size": tok.vocab_size,
    }
