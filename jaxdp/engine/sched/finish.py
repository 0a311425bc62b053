"""Why a request finishes: the one stop rule every place that books a token asks (`finish_reason`).

A request stops ("stop") at an end-of-sequence token unless it ignores them, at one of its stop token ids, or once
its text holds one of its stop strings, unless it has fewer output tokens than its min_new_tokens (vLLM's and
SGLang's rule: the sampler holds its stop ids off until then too); else it ends ("length") at its output limit.
A request with a grammar stops once its grammar reached its end (its matcher accepted the token, booking's work),
before any other rule: nothing can follow the end. Further conditions (a stop regex) belong here, beside these.
"""

from __future__ import annotations

from collections.abc import Container

from jaxdp.engine.sched.request import Request


def finish_reason(req: Request, token: int, n_out: int, limit: int, eos_token_ids: Container[int]) -> str | None:
    """Why `req` finishes at `token`, its `n_out`-th output token (already in `req.output_ids`, which a stop
    string's check reads), given its output `limit` and the model's end-of-sequence ids: "stop", "length", or None
    while it goes on."""
    p = req.params
    if req.matcher is not None and req.matcher.terminated():
        return "stop"
    if n_out < p.min_new_tokens:
        return "length" if n_out >= limit else None
    if token in eos_token_ids and not p.ignore_eos:
        return "stop"
    if token in p.stop_token_ids:
        return "stop"
    if req.stop_check is not None and req.stop_check(req):
        return "stop"
    if n_out >= limit:
        return "length"
    return None
