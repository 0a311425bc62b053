"""A request's progress as another process sees it: the tokens booked since the last report, and its end.

The process that runs a request reports, after a step, each changed request as one `Update`; the process
that holds a stand-in `Request` for it (node 0 for another node's ranks, the HTTP process for an engine in a
process of its own) applies them, so its streams, metrics and controller see the request as a local one. A
request travels the other way as a `SentRequest`. Both are typed messages of `jaxdp.engine.ipc.messages`' codec;
this module alone makes and reads them.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from jaxdp.engine.sched.request import Bootstrap, Request, SamplingParams, State, stop_string_check

Pairs = list[tuple[int, float]]  # (token id, logprob) per alternative


class SentRequest(msgspec.Struct, array_like=True, frozen=True):
    """A request as it travels to the process that runs it."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    rank: int
    bootstrap: Bootstrap | None = None


class PromptLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """The prompt's logprobs, all booked with the first output token (the step that reads its prompt's end)."""

    logprobs: list[float | None]
    top: list[Pairs | None]
    chosen: list[Pairs | None]


class Update(msgspec.Struct, array_like=True, frozen=True):
    """What changed in a request since the last report."""

    rid: str
    ids: list[int]  # new token ids
    logprobs: list[float]  # theirs (when it asks)
    top: list[Pairs]  # their top logprobs (when it asks)
    cached_tokens: int  # prompt tokens found in the prefix cache
    finish: str | None  # the finish reason once it finished
    error: str | None
    error_status: int | None
    chosen: list[Pairs]  # the logprobs of the token ids it asked about (token_ids_logprob)
    prompt: PromptLogprobs | None  # in the first update only
    spec: tuple[int, int] = (0, 0)  # speculative decoding: (verify steps, draft tokens accepted) so far


def sent(req: Request) -> SentRequest:
    return SentRequest(req.rid, req.prompt_ids, req.params, req.rank, req.bootstrap)


def received(msg: SentRequest, tokenizer) -> Request:
    """The request `sent` made, to run here (with its stop strings checked against this tokenizer)."""
    req = Request(msg.rid, list(msg.prompt_ids), msg.params, rank=msg.rank, bootstrap=msg.bootstrap)
    if (req.params.stop or req.params.stop_regex) and tokenizer is not None:
        req.stop_check = stop_string_check(tokenizer, req.params.stop, req.params.stop_regex)
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
    prompt = PromptLogprobs(req.input_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs) \
        if sent == 0 else None
    return Update(req.rid, ids[sent:], lps, tops, req.cached_tokens, req.finish_reason if req.finished else None,
                  req.error, req.error_status, chosen, prompt, (req.spec_verify_ct, req.spec_accepted)), len(ids)


def apply(requests: dict[str, Request], updates: Iterable[Update], now: float) -> None:
    """Apply reported updates to the stand-ins; each changed one's `on_update` is called."""
    for u in updates:
        req = requests.get(u.rid)
        if req is None or req.finished:
            continue
        req.output_ids.extend(u.ids)
        req.output_logprobs.extend(u.logprobs)
        req.output_top_logprobs.extend(u.top)
        req.output_token_ids_logprobs.extend(u.chosen)
        if u.prompt is not None:
            req.input_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs = (
                list(u.prompt.logprobs), list(u.prompt.top), list(u.prompt.chosen))
        req.cached_tokens = u.cached_tokens
        req.spec_verify_ct, req.spec_accepted = u.spec
        if u.ids and req.first_token_at is None:
            req.first_token_at = now
        if u.finish:
            if u.error_status is not None:
                req.error_status = u.error_status
            end(req, u.finish, u.error, now)
        else:
            req.state = State.RUNNING
            if u.ids and req.on_update:
                req.on_update(req)


def end(req: Request, reason: str, error: str | None, now: float) -> None:
    """End a request outside a scheduler (a stand-in, or on failure)."""
    req.output_ids = list(req.done_ids)
    req.finish_reason, req.error = reason, error if error is not None else req.error
    req.state, req.finished_at = State.FINISHED, now
    if req.on_update:
        req.on_update(req)
