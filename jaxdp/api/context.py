"""What the endpoints share at run time: the ServerContext (backend, tokenizer, limits, the requests in flight)
and running a call's requests to the end. The routers (native, openai_api) import this module, and the app
(`jaxdp.api.app`) imports the routers, so nothing imports back.

Every request in flight is known here, which is what the limits need: `--max-queued-requests` counts the
ones still waiting, `--request-timeout` ends one that runs too long, and a graceful shutdown (`drain`) lets
the running ones finish and ends the rest, each with an error its client sees (a JSON error, or an error
event on a stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from jaxdp.api.common import ApiError, TextView, sse, watch_disconnect
from jaxdp.api.fields import check_fields, check_length, parse_json
from jaxdp.api.metrics import ServerMetrics
from jaxdp.api.replicas import ReplicaSet
from jaxdp.config import UnsupportedConfigError
from jaxdp.engine import BadRequest, Request, SamplingParams
from jaxdp.engine.sched.request import Bootstrap, State
from jaxdp.grammar import Grammars

log = logging.getLogger("jaxdp.serve")

TEXT_SLACK = 4  # a normalizer may fold a few characters into one (NFC composes accents): room for that


@dataclasses.dataclass
class Limits:
    """What one client may ask of the server (`python -m jaxdp.serve` flags)."""

    max_request_bytes: int = 16 * 2**20
    max_queued_requests: int | None = None  # requests waiting for a rank, all ranks together
    request_timeout_s: float | None = None  # from the start of a request to its last token
    graceful_shutdown_timeout_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class ChatParsing:
    """How a chat's output text becomes OpenAI's message fields (`--tool-call-parser`, `--reasoning-parser`):
    SGLang's parser names (`jaxdp.api.parsers`), None for no parser (the text is all content)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """One request of an HTTP call, with how its text is shown."""

    req: Request
    view: TextView
    prompt_index: int  # which prompt of the call (a batch, or n choices of one prompt)
    client_rid: str | None = None  # the rid the client sent (n > 1 choices get rid-0, rid-1, ...)


@dataclasses.dataclass
class ServerContext:
    backend: ReplicaSet
    tokenizer: Any
    metrics: ServerMetrics
    served_model_name: str
    model_path: str
    server_args: dict[str, Any]
    api_key: str | None = None
    limits: Limits = dataclasses.field(default_factory=Limits)
    parsing: ChatParsing = dataclasses.field(default_factory=ChatParsing)
    grammars: Grammars | None = None  # --grammar-backend's service (None: none), compiling requests' grammars
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    live: set[Job] = dataclasses.field(default_factory=set)  # submitted and not yet ended (the event loop's)
    draining: bool = False  # a shutdown is under way: new requests get a 503
    warned: set[str] = dataclasses.field(default_factory=set)  # deprecations, unknown fields: logged once

    @property
    def vocab_size(self) -> int:
        return self.backend.model_cfg.vocab_size

    # ---- prompts ---------------------------------------------------------------------------------
    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ApiError(f"this server has no tokenizer (--skip-tokenizer-init, or the checkpoint has no "
                           f"tokenizer.json), so it cannot read {what}; send token ids (input_ids) instead")

    def check_text_length(self, chars: int, what: str, rank: int | None) -> None:
        """Refuse, before tokenizing, a text that no tokenization could fit in the context."""
        per_token = getattr(self.tokenizer, "max_token_chars", None)
        context = self.context_len(rank)
        if per_token and chars > TEXT_SLACK * per_token * context:
            raise ApiError(f"{what} has {chars} characters, more than a context of {context} tokens can hold; "
                           "shorten it", param="prompt")

    async def encode(self, texts: list[str], what: str = "text", rank: int | None = None) -> list[list[int]]:
        """Token ids of each text, tokenized off the event loop once the lengths are known to be possible."""
        self._need_tokenizer(what)
        for text in texts:
            if not text:
                raise ApiError(f"the prompt is empty; send at least one character of {what}", param="prompt")
            self.check_text_length(len(text), "the prompt", rank)
        return await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])

    async def encode_chat(self, messages: list[dict[str, Any]], rank: int | None = None, *,
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation's prompt tokens: rendered by the checkpoint's chat template with `tools` and the
        request's chat_template_kwargs, then tokenized, off the event loop. Assistant tool calls go to the template
        with their arguments as the client sent them (a JSON string, which DeepSeek's templates write as it
        stands); a template that cannot read that is given them again as objects (SGLang's shape, which GLM's
        templates iterate)."""
        self._need_tokenizer("chat messages")
        self.check_text_length(_text_chars([messages, tools, template_kwargs]), "the conversation", rank)
        kwargs = template_kwargs or {}

        def apply(conversation: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tools=tools, **kwargs)

        def render() -> list[int]:
            try:
                text = apply(messages)
            except Exception as e:  # a template that refuses the conversation (jinja2 raise_exception, none)
                objects = _arguments_as_objects(messages)
                try:
                    if objects is None:
                        raise
                    text = apply(objects)
                except Exception:
                    why = (str(e).splitlines() or [type(e).__name__])[0][:200]
                    raise ApiError(f"the chat template refused these messages: {why}", param="messages") from None
            return self.tokenizer.encode(text)

        return await asyncio.to_thread(render)

    def context_len(self, rank: int | None) -> int:
        """The pinned rank's context, or the smallest of all (where an unpinned request may go)."""
        b = self.backend
        if rank is not None and isinstance(rank, int) and 0 <= rank < b.num_ranks:
            return b.context_len(rank)
        return min(b.context_len(r) for r in range(b.num_ranks))

    # ---- requests --------------------------------------------------------------------------------
    def queued(self) -> int:
        return sum(1 for job in self.live if job.req.state is State.WAITING)

    def make_jobs(self, prompts: list[list[int]], params: list[SamplingParams], n: int, *, rank: int | None = None,
                  rids: list[str | None] | None = None, skip_special_tokens: bool = True,
                  bootstraps: list[Bootstrap | None] | None = None) -> list[Job]:
        """n requests per prompt, made and checked before any is submitted; a refusal raises ApiError.
        `bootstraps`: each prompt's bootstrap room under prefill/decode disaggregation."""
        if bootstraps is not None and n > 1:
            raise ApiError("n > 1 is not served under disaggregation (one bootstrap room names one request); "
                           "send n: 1", param="n")
        limit = self.limits.max_queued_requests
        if limit is not None and self.queued() + len(prompts) * n > limit:
            raise ApiError(f"the server's queue is full ({limit} requests waiting, --max-queued-requests); retry "
                           "in a moment", 503, "server_error", headers={"Retry-After": "1"})
        jobs: list[Job] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                if not ids:
                    raise ApiError("the prompt is empty; send at least one token", param="prompt")
                sp = check_length(sp, len(ids), self.context_len(rank))
                if sp.stop and self.tokenizer is None:
                    raise ApiError("stop strings need a tokenizer, which this server does not have; use "
                                   "stop_token_ids instead", param="stop")
                for j in range(n):
                    p = dataclasses.replace(sp, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids))
                    if p.seed is not None and j:
                        p.seed += j  # n samples with one seed: different but reproducible
                    rid = rids[i] if rids else None
                    if rid is not None and n > 1:
                        rid = f"{rid}-{j}"
                    req = self.backend.make_request(ids, p, rid=rid, rank=rank,
                                                    bootstrap=bootstraps[i] if bootstraps else None)
                    # (the engine checks the stops; the view cuts the text there)
                    view = TextView(self.tokenizer, p.stop, skip_special_tokens, p.stop_regex, not p.no_stop_trim)
                    jobs.append(Job(req, view, i, rids[i] if rids else None))
        except (BadRequest, UnsupportedConfigError) as e:
            for job in jobs:
                self.backend.discard(job.req)
            raise ApiError(str(e)) from None
        except BaseException:  # an ApiError, or the engine failed meanwhile: nothing made here stays in the ledger
            for job in jobs:
                self.backend.discard(job.req)
            raise
        return jobs

    def end_with_error(self, job: Job, message: str, status: int) -> None:
        """End a request in flight with an error its client sees (the engine frees its pages)."""
        req = job.req
        if not req.finished:
            req.error, req.error_status = message, status
            self.backend.abort(req.rid)

    def abort(self, rid: str | None) -> int:
        """SGLang's /abort_request: end the request with this rid (and its n choices), or all with None.
        The client gets what was generated so far with finish_reason abort. Returns how many were aborted."""
        hit = [j for j in self.live if rid is None or rid in (j.req.rid, j.client_rid)]
        for job in hit:
            self.backend.abort(job.req.rid)
        return len(hit)

    async def drain(self) -> None:
        """A graceful shutdown: new requests get a 503 from now on; those in flight may finish within
        --graceful-shutdown-timeout; the rest then end with an error (503) their clients see."""
        self.draining = True
        timeout = self.limits.graceful_shutdown_timeout_s
        log.info("shutting down: %d requests in flight may finish within %g s", len(self.live), timeout)
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live:
            log.info("shutting down: ending %d unfinished requests", len(self.live))
            for job in list(self.live):
                self.end_with_error(job, f"the server shut down before this request finished (it waited "
                                         f"--graceful-shutdown-timeout {timeout:g} s); retry on another server",
                                    503)
            deadline = time.monotonic() + 5.0  # time for the engine to end them and their answers to go out
            while self.live and time.monotonic() < deadline:
                await asyncio.sleep(0.05)


def _text_chars(value: Any) -> int:
    """The characters of every string in a JSON value (keys included): what a template can copy into a prompt."""
    chars, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return chars


def _arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`messages` with each assistant tool call's JSON arguments parsed into an object, or None when none was a
    JSON object written as a string (there is nothing else to try)."""
    changed, out = False, []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            new_calls = []
            for call in calls:
                function = call.get("function") or {}
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        parsed = json.loads(arguments)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        call = call | {"function": function | {"arguments": parsed}}
                        changed = True
                new_calls.append(call)
            message = message | {"tool_calls": new_calls}
        out.append(message)
    return out if changed else None


async def read_json(http: HttpRequest) -> dict[str, Any]:
    """The body as a JSON object (parsed off the event loop when it is large)."""
    raw = await http.body()
    return parse_json(raw) if len(raw) < 2**16 else await asyncio.to_thread(parse_json, raw)


def checked_fields(ctx: ServerContext, body: dict, table: str, *, where: str = "") -> None:
    """Refuse what `body` asks and this server does not serve (the field table, `jaxdp.api.field_table`); a
    field the table does not list is served without it, and logged once per name (vLLM's habit)."""
    for name in check_fields(body, table, where=where):
        key = f"{table} {name}"[:200]
        if key not in ctx.warned and len(ctx.warned) < 1000:  # (a client cannot grow the set without bound)
            ctx.warned.add(key)
            log.warning("%s: the field %r is not one this server knows; it was ignored (docs/api.md lists the "
                        "fields it takes)", table, f"{where}{name}"[:100])


def pinned_rank(body: dict, http: HttpRequest) -> int | None:
    """The rank a request asks for: routed_dp_rank, data_parallel_rank (deprecated) or the header."""
    ctx: ServerContext = http.app.state.ctx
    rank = body.get("routed_dp_rank")
    if rank is None and body.get("data_parallel_rank") is not None:
        if "data_parallel_rank" not in ctx.warned:
            ctx.warned.add("data_parallel_rank")
            log.warning("data_parallel_rank is deprecated; send routed_dp_rank instead")
        rank = body["data_parallel_rank"]
    header = http.headers.get("x-data-parallel-rank")
    if rank is None and header is not None:
        if not header.strip().isdigit() or len(header) > 9:
            raise ApiError(f"the X-Data-Parallel-Rank header {header[:20]!r} is not an integer rank")
        rank = int(header)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise ApiError(f"routed_dp_rank must be an integer, got {str(rank)[:40]!r}", param="routed_dp_rank")
    num_ranks = ctx.backend.num_ranks
    if rank is not None and not 0 <= rank < num_ranks:
        raise ApiError(f"routed_dp_rank {rank} is out of range; this server has DP ranks 0..{num_ranks - 1}",
                       param="routed_dp_rank")
    return rank


def bootstraps(body: dict, n_prompts: int) -> list[Bootstrap | None] | None:
    """Prefill/decode disaggregation: the bootstrap fields SGLang's router adds to a request (`bootstrap_host`,
    `bootstrap_port`, `bootstrap_room`, and `disagg_prefill_dp_rank` when it pins the prefill rank), one per
    prompt (lists for a batch); None when the request has none."""
    names = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank")
    given = {k: body.get(k) for k in names if body.get(k) is not None}
    if not given:
        return None
    if set(given) - {"disagg_prefill_dp_rank"} != set(names[:3]):
        missing = [k for k in names[:3] if k not in given]
        raise ApiError(f"{missing[0]} is missing: a request under disaggregation carries bootstrap_host, "
                       "bootstrap_port and bootstrap_room (SGLang's router adds them)", param=missing[0])

    def each(name: str, kind: type, ok) -> list:
        v = given.get(name)
        values = v if isinstance(v, list) else [v] * n_prompts
        if len(values) != n_prompts or not all(x is None or (isinstance(x, kind) and not isinstance(x, bool)
                                                             and ok(x)) for x in values):
            raise ApiError(f"{name} {str(v)[:60]} is not valid here: one per prompt, each a {kind.__name__} in range",
                           param=name)
        return values

    hosts = each("bootstrap_host", str, lambda x: 0 < len(x) <= 255)
    ports = each("bootstrap_port", int, lambda x: 0 < x < 65536)
    rooms = each("bootstrap_room", int, lambda x: 0 <= x < 2**63)
    ranks = each("disagg_prefill_dp_rank", int, lambda x: x >= 0)
    return [Bootstrap(h, p, r, k) for h, p, r, k in zip(hosts, ports, rooms, ranks, strict=True)]


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """A server-sent event answer; an exception while it streams ends it with an error event and [DONE]
    (the status line has gone out already, so this is the only way left to tell the client)."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as e:
            log.exception("internal error while streaming an answer")
            yield sse({"error": {"message": f"internal server error ({type(e).__name__}); see the server log",
                                 "type": "server_error", "code": 500}})
            yield sse("[DONE]")

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def run_jobs(ctx: ServerContext, jobs: list[Job]) -> AsyncIterator[int]:
    """Stream all jobs together; yields the index of the job that changed. Closing it aborts the rest.
    Past --request-timeout the unfinished jobs end with a 408 error.

    A token costs one wake-up here: one job is read straight from its stream; several are fanned in through
    one queue (a task per job). The timeout is one timer for the call, not a wait per token."""
    loop = asyncio.get_running_loop()
    backend, timeout = ctx.backend, ctx.limits.request_timeout_s

    def expire() -> None:
        for job in jobs:
            ctx.end_with_error(job, f"the request ran longer than the server's --request-timeout of {timeout:g} s; "
                                    "ask for fewer tokens or retry", 408)

    timer = None if timeout is None else loop.call_later(timeout, expire)
    ctx.live.update(jobs)
    try:
        if len(jobs) == 1:
            async with contextlib.aclosing(backend.stream(jobs[0].req)) as updates:
                async for _ in updates:
                    yield 0
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int, job: Job) -> None:
            try:
                async for _ in backend.stream(job.req):
                    queue.put_nowait(i)
            finally:
                ctx.live.discard(job)
                queue.put_nowait(-1)

        tasks = [asyncio.create_task(one(i, job)) for i, job in enumerate(jobs)]
        try:
            done = 0
            while done < len(jobs):
                i = await queue.get()
                if i < 0:
                    done += 1
                else:
                    yield i
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if timer is not None:
            timer.cancel()
        ctx.live.difference_update(jobs)


def job_error(job: Job) -> ApiError | None:
    """A request the engine refused or failed, or the server ended, as the error the client gets."""
    req = job.req
    if req.finish_reason == "abort" and req.error:
        status = req.error_status or (500 if req.error.startswith("internal") else 400)
        return ApiError(req.error, status, "server_error" if status >= 500 else "invalid_request_error")
    return None


async def complete_jobs(http, ctx: ServerContext, jobs: list[Job]) -> None:
    """Run non-streamed jobs to the end (aborting them if the client goes away); raise the first error."""
    async with watch_disconnect(http, ctx.backend, [j.req.rid for j in jobs]):
        async for _ in run_jobs(ctx, jobs):
            pass
    for job in jobs:
        if (err := job_error(job)) is not None:
            raise err
