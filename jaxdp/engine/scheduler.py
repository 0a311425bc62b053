"""One Scheduler per DP rank: its own waiting queue, running batch, page pool and prefix cache.

`schedule` picks the rank's next batch: prompt chunks first (admitting waiting requests within the
chunk budget and with a reservation for their future tokens), else one decode token per running
request (evicting cached pages, then retracting requests back to the queue, when the pool runs dry).
`book` takes the sampled tokens back. A request never leaves its rank. Nothing here knows of arrays
on devices or of Flax: a plan is a list of `Piece`s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

from jaxdp.batch import Piece
from jaxdp.engine.mixed import add_decoders, decoders_to_carry
from jaxdp.engine.pool import PagePool, PrefixCache
from jaxdp.engine.request import BadRequest, Request, State

log = logging.getLogger("jaxdp.scheduler")


@dataclasses.dataclass
class RankPlan:
    kind: str  # "extend" | "decode"
    reqs: list[Request]
    pieces: list[Piece]
    sample: list[bool]  # the piece ends its request's context: its last row yields a token
    out_pos: list[int] = dataclasses.field(default_factory=list)  # where that token goes in output_ids

    @property
    def rows(self) -> int:
        return sum(len(p.tokens) for p in self.pieces)


@dataclasses.dataclass
class SchedulerConfig:
    chunk_size: int  # prompt tokens per step on this rank
    max_running: int
    context_len: int
    conservativeness: float = 1.0  # reservation for future tokens (x0.3 under attention DP)
    eos_token_ids: tuple[int, ...] = ()


class Scheduler:
    def __init__(self, rank: int, pool: PagePool, cache: PrefixCache, cfg: SchedulerConfig):
        self.rank, self.pool, self.cache, self.cfg = rank, pool, cache, cfg
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.retracted_total = 0

    # ---- admission -----------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Refuse what this rank can never serve (the context is capped by the pool, so this covers both)."""
        if len(req.prompt_ids) + 1 > self.cfg.context_len:
            raise BadRequest(f"the prompt has {len(req.prompt_ids)} tokens but a rank holds at most "
                             f"{self.cfg.context_len} (context length / KV pool); shorten the prompt")

    def add(self, req: Request) -> None:
        self.check(req)
        req.rank = self.rank
        self.waiting.append(req)

    @property
    def num_tokens(self) -> int:
        """Tokens held by this rank's requests (the total_tokens balancing signal)."""
        running, waiting = list(self.running), list(self.waiting)  # snapshots: other threads read this
        return sum(r.num_tokens for r in running) + sum(len(r.prompt_ids) for r in waiting)

    @property
    def token_usage(self) -> float:
        used = self.pool.num_pages - self.pool.free - self.cache.evictable()
        return used / self.pool.num_pages

    def state(self) -> dict:
        """This rank's figures for /get_load, /get_server_info, metrics and logs (plain numbers, so another
        node can send them to node 0). Other threads read this while the loop changes it: retried."""
        for _ in range(3):
            try:
                running, waiting = list(self.running), list(self.waiting)
                pool, cache = self.pool, self.cache
                return {
                    "num_running_reqs": len(running), "num_queue_reqs": len(waiting),
                    "num_reqs": len(running) + len(waiting),
                    "num_tokens": sum(r.num_tokens for r in running) + sum(len(r.prompt_ids) for r in waiting),
                    "num_used_tokens": (pool.num_pages - pool.free) * pool.page_size,
                    "token_usage": self.token_usage,
                    "max_total_num_tokens": pool.num_pages * pool.page_size,
                    "page_size": pool.page_size, "num_pages": pool.num_pages, "free_pages": pool.free,
                    "cached_pages": cache.size,
                    "cache_hit_rate": cache.hit_tokens / cache.queried_tokens if cache.queried_tokens else 0.0,
                    "retracted_reqs": self.retracted_total,
                }
            except RuntimeError:  # a dict resized mid-read
                continue
        raise RuntimeError("the scheduler kept changing while its state was read")

    def _available(self) -> int:
        return self.pool.free + self.cache.evictable()

    def _reserved(self, reqs) -> int:
        return sum(self.pool.pages_for(int(r.remaining_new_tokens() * self.cfg.conservativeness)) for r in reqs)

    def _take_pages(self, n: int) -> list[int] | None:
        if n > self.pool.free:
            self.cache.evict(n - self.pool.free)
        return self.pool.alloc(n)

    # ---- picking the next batch ----------------------------------------------------------------
    def schedule(self, allow_new_prompt: bool = True, mixed_chunk: bool = False) -> RankPlan | None:
        """`allow_new_prompt`: False while the prefill delayer holds new prompts back (a prompt already being
        read goes on). `mixed_chunk`: a prompt step carries this rank's decoders too (jaxdp/engine/mixed.py)."""
        if self.waiting:
            carry = decoders_to_carry(self.running, self._decodable, self.cfg.chunk_size) if mixed_chunk else []
            plan = self._schedule_extend(allow_new_prompt, self.cfg.chunk_size - len(carry))
            if plan is not None:
                add_decoders(plan, carry, self.pool, self._take_pages)
                return plan
        return self._schedule_decode() if self.running else None

    @property
    def prompt_ready(self) -> bool:
        """A prompt waits that this rank could read now (what the prefill delayer announces)."""
        return bool(self.waiting) and len(self.running) < self.cfg.max_running

    def _schedule_extend(self, allow_new_prompt: bool = True, budget: int | None = None) -> RankPlan | None:
        plan = RankPlan("extend", [], [], [])
        budget = self.cfg.chunk_size if budget is None else budget
        reserved = self._reserved(self.running)
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) + len(plan.reqs) >= self.cfg.max_running:
                break
            if not allow_new_prompt and not req.pages:  # the prefill delayer holds new prompts back
                break
            fresh = not req.pages
            if fresh:
                shared = self.cache.match(req.all_ids[: req.num_tokens - 1])
                req.pages, req.shared_pages, req.computed = shared, len(shared), len(shared) * self.pool.page_size
                if not req.output_ids:
                    req.cached_tokens = req.computed
            n = min(budget, req.num_tokens - req.computed)
            need = self.pool.pages_for(req.computed + n) - len(req.pages)
            ends = req.computed + n == req.num_tokens
            reserve = self._reserved([req]) if ends else 0
            if need + reserve > self._available() - reserved or (pages := self._take_pages(need)) is None:
                if fresh:  # give the prefix back; try again on a later step
                    self.cache.unlock(req.pages[: req.shared_pages])
                    req.pages, req.shared_pages, req.computed = [], 0, 0
                break
            req.pages += pages
            plan.reqs.append(req)
            plan.pieces.append(Piece(req.all_ids[req.computed: req.computed + n], req.computed, req.pages))
            plan.sample.append(ends)
            req.computed += n  # the step writes these latents, whenever its tokens are booked
            budget -= n
            reserved += reserve
            if ends:  # decodes from the next step on (its first token may still be in flight)
                self.waiting.remove(req)
                req.state = State.RUNNING
                self.running.append(req)
        return plan if plan.reqs else None

    def _decodable(self, req: Request) -> bool:
        """False while the request's last token is in flight and will end it (length or context)."""
        return req.remaining_new_tokens() > 0 and req.num_tokens < self.cfg.context_len

    def _schedule_decode(self) -> RankPlan | None:
        for req in list(self.running):
            if req.state != State.RUNNING or not self._decodable(req):
                continue
            need = self.pool.pages_for(req.num_tokens) - len(req.pages)
            if need <= 0:
                continue
            while (pages := self._take_pages(need)) is None and self.running:
                self._retract(self.running[-1])
                if req.state != State.RUNNING:
                    break
            if req.state == State.RUNNING and pages is not None:
                req.pages += pages
        plan = RankPlan("decode", [], [], [])
        for req in self.running:
            if not self._decodable(req):
                continue
            plan.reqs.append(req)
            plan.pieces.append(Piece([req.all_ids[-1]], req.num_tokens - 1, req.pages))
            plan.sample.append(True)
            req.computed = req.num_tokens
        return plan if plan.reqs else None

    def _retract(self, req: Request) -> None:
        """Back to the front of the queue; its full pages go to the prefix cache, so resuming is cheap."""
        self.running.remove(req)
        self.cache.insert(req.all_ids[: req.computed], req.pages, req.shared_pages)
        req.pages, req.shared_pages, req.computed = [], 0, 0
        req.state = State.WAITING
        req.retractions += 1
        self.retracted_total += 1
        self.waiting.appendleft(req)
        log.info("rank %d: retracted request %s (KV pool full); it resumes when pages free up", self.rank, req.rid)

    # ---- booking the results -------------------------------------------------------------------
    def book(self, plan: RankPlan, tokens: list[int], logprobs: list[float] | None, now: float) -> list[Request]:
        """Put one step's sampled tokens in place of their markers; returns the requests that finished.

        With the overlap the next step was already planned: a request that finishes here may have a row
        in it, whose token is dropped when that step is booked.
        """
        done = []
        for i, req in enumerate(plan.reqs):
            if not plan.sample[i] or req.finished:  # a prompt chunk, or aborted / finished meanwhile
                continue
            pos = plan.out_pos[i]
            req.output_ids[pos] = int(tokens[i])
            if req.params.return_logprob and logprobs is not None:
                req.output_logprobs.append(float(logprobs[i]))
            if req.first_token_at is None:
                req.first_token_at = now
            reason = self._finish_reason(req, pos)
            if reason:
                del req.output_ids[pos + 1:]  # tokens of a step planned before this one was booked
                req.computed = min(req.computed, req.num_tokens - 1)
                self.finish(req, reason, now)
                done.append(req)
            elif req.on_update:
                req.on_update(req)
        return done

    def _finish_reason(self, req: Request, pos: int) -> str | None:
        tok, p = req.output_ids[pos], req.params
        if (tok in self.cfg.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if req.stop_check is not None and req.stop_check(req):
            return "stop"
        if pos + 1 >= p.max_new_tokens or len(req.prompt_ids) + pos + 1 >= self.cfg.context_len:
            return "length"
        return None

    def finish(self, req: Request, reason: str, now: float) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.pages:
            self.cache.insert(req.all_ids[: req.computed], req.pages, req.shared_pages)
            req.pages = []
        req.output_ids = list(req.done_ids)  # an abort may leave tokens in flight: they are dropped
        req.state, req.finish_reason, req.finished_at = State.FINISHED, reason, now
        if req.on_update:
            req.on_update(req)

    def abort(self, rid: str, now: float) -> Request | None:
        for req in list(self.running) + list(self.waiting):
            if req.rid == rid:
                self.finish(req, "abort", now)
                return req
        return None
