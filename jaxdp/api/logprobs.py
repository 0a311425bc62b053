"""Logprobs as each API shows them: OpenAI completions (`echo`: the prompt's tokens first, the first one's logprob
null), vLLM's `prompt_logprobs`, and SGLang's meta_info (`input_token_logprobs`, `input_top_logprobs`,
`output_token_logprobs`, `output_top_logprobs`, `input_token_ids_logprobs`, `output_token_ids_logprobs`).
The numbers are the engine's (`jaxdp.engine.step.prompt_logprobs`); this module only lays them out."""

from __future__ import annotations

from typing import Any

from jaxdp.api.common import done_ids
from jaxdp.engine.sched.request import Request


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else str(token)


def _top_dict(tokenizer, alts, token: int, lp: float | None, k: int) -> dict[str, float] | None:
    """OpenAI's top_logprobs entry: the k best (text: logprob) and the token itself (vLLM's layout)."""
    if lp is None:
        return None
    out = {token_text(tokenizer, t): a for t, a in (alts or [])[:k]}
    out.setdefault(token_text(tokenizer, token), lp)
    return out


def completion_logprobs(tokenizer, req: Request, k: int, echo: bool, hide_output: bool) -> dict[str, Any]:
    """A completions choice's `logprobs`: with echo the prompt's tokens first (from position 0: the first logprob
    is null), then the generated ones (none with max_tokens 0)."""
    ids, lps = ([], []) if hide_output else (done_ids(req), list(req.output_logprobs))
    tops = req.output_top_logprobs if k else [None] * len(ids)
    if echo:
        prompt_tops = req.input_top_logprobs if k else [None] * len(req.prompt_ids)
        ids, lps = list(req.prompt_ids) + ids, list(req.input_logprobs) + lps
        tops = list(prompt_tops) + list(tops)
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets, at = [], 0  # into the choice's text, where special tokens (the BOS) take no characters
    for t in ids:
        offsets.append(at)
        at += len(tokenizer.decode([t])) if tokenizer else 0
    top = [_top_dict(tokenizer, alts, t, lp, k) for t, lp, alts in zip(ids, lps, tops, strict=False)]
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer, req: Request, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}
    with the prompt's token and the k best (rank: its place among them; null for a prompt token outside them)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    tops = req.input_top_logprobs if k else [None] * len(req.prompt_ids)
    for token, lp, alts in zip(req.prompt_ids, req.input_logprobs, tops, strict=False):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": a, "rank": i + 1, "decoded_token": token_text(tokenizer, t)}
                 for i, (t, a) in enumerate((alts or [])[:k])}
        entry.setdefault(str(token), {"logprob": lp, "rank": None, "decoded_token": token_text(tokenizer, token)})
        out.append(entry)
    return out


def sglang_meta(tokenizer, req: Request) -> dict[str, Any]:
    """SGLang's logprob fields of meta_info: [logprob, token id, text] triples (the first prompt token's logprob
    null); top and chosen-id lists per position (null where nothing predicts it)."""
    p = req.params
    ids = done_ids(req)
    start = max(p.logprob_start_len, 0)
    prompt = req.prompt_ids[start:] if p.logprob_start_len >= 0 else []

    def triples(pairs) -> list | None:
        return None if pairs is None else [[lp, t, token_text(tokenizer, t)] for t, lp in pairs]

    meta: dict[str, Any] = {
        "input_token_logprobs": [[lp, t, token_text(tokenizer, t)] for lp, t in zip(req.input_logprobs, prompt,
                                                                                     strict=False)],
        "output_token_logprobs": [[lp, t, token_text(tokenizer, t)] for lp, t in zip(req.output_logprobs, ids,
                                                                                      strict=False)],
    }
    if p.top_logprobs:
        meta["input_top_logprobs"] = [triples(a) for a in req.input_top_logprobs]
        meta["output_top_logprobs"] = [triples(a) for a in req.output_top_logprobs[: len(ids)]]
    if p.token_ids_logprob:
        meta["input_token_ids_logprobs"] = [triples(a) for a in req.input_token_ids_logprobs]
        meta["output_token_ids_logprobs"] = [triples(a) for a in req.output_token_ids_logprobs[: len(ids)]]
    return meta
