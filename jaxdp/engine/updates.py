"""A request's progress as another process sees it: the tokens booked since the last report, and its end.

The process that runs a request reports, after a step, each changed request as one tuple; the process that
holds a stand-in `Request` for it (node 0 for another node's ranks, the HTTP process for an engine in a
process of its own) applies the tuples, so its streams, metrics and controller see the request as a local
one. One format, read and written only here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxdp.engine.request import Request, SamplingParams, State, stop_string_check

# (rid, new token ids, their logprobs, their top logprobs, cached prompt tokens, finish reason or None,
#  error, error status, their chosen ids' logprobs, the prompt's (logprobs, top logprobs, chosen ids' logprobs)
#  in the first update only)
Update = tuple


def sent(req: Request) -> tuple:
    """A request as it travels to the process that runs it."""
    return req.rid, req.prompt_ids, dataclasses.asdict(req.params), req.rank


def received(fields: tuple, tokenizer) -> Request:
    """The request `sent` made, to run here (with its stop strings checked against this tokenizer)."""
    rid, prompt_ids, params, rank = fields
    req = Request(rid, prompt_ids, SamplingParams(**params), rank=rank)
    if req.params.stop and tokenizer is not None:
        req.stop_check = stop_string_check(tokenizer, req.params.stop)
    return req


def report(req: Request, sent: int) -> tuple[Update | None, int]:
    """The request's update since `sent` tokens were reported (None if nothing changed), and the new count."""
    ids = req.done_ids
    if len(ids) <= sent and not req.finished:
        return None, sent
    p = req.params
    lps = req.output_logprobs[sent:len(ids)] if p.return_logprob else []
    tops = req.output_top_logprobs[sent:len(ids)] if p.top_logprobs else []
    chosen = req.output_token_ids_logprobs[sent:len(ids)] if p.token_ids_logprob else []
    # the prompt's logprobs are all booked with the first output token (the step that reads its prompt's end)
    prompt = (req.input_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs) if sent == 0 else None
    return (req.rid, ids[sent:], lps, tops, req.cached_tokens, req.finish_reason if req.finished else None,
            req.error, req.error_status, chosen, prompt), len(ids)


def apply(requests: dict[str, Request], updates: Iterable[Update], now: float) -> None:
    """Apply reported updates to the stand-ins; each changed one's `on_update` is called."""
    for rid, ids, lps, tops, cached, finish, error, status, chosen, prompt in updates:
        req = requests.get(rid)
        if req is None or req.finished:
            continue
        req.output_ids.extend(ids)
        req.output_logprobs.extend(lps)
        req.output_top_logprobs.extend(tops)
        req.output_token_ids_logprobs.extend(chosen)
        if prompt is not None:
            req.input_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs = (list(x) for x in prompt)
        req.cached_tokens = cached
        if ids and req.first_token_at is None:
            req.first_token_at = now
        if finish:
            if status is not None:
                req.error_status = status
            end(req, finish, error, now)
        else:
            req.state = State.RUNNING
            if ids and req.on_update:
                req.on_update(req)


def end(req: Request, reason: str, error: str | None, now: float) -> None:
    """End a request outside a scheduler (a stand-in, or on failure)."""
    req.output_ids = list(req.done_ids)
    req.finish_reason, req.error = reason, error if error is not None else req.error
    req.state, req.finished_at = State.FINISHED, now
    if req.on_update:
        req.on_update(req)
