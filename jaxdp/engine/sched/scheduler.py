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
import time
from collections import deque

import numpy as np

from jaxdp.batch import Piece
from jaxdp.engine.sched.finish import finish_reason
from jaxdp.engine.sched.mixed import add_decoders, decoders_to_carry
from jaxdp.engine.sched.policy import NO_DISAGG, Disagg
from jaxdp.engine.sched.pool import PagePool, PrefixCache
from jaxdp.engine.sched.rank_plan import RankPlan
from jaxdp.engine.sched.request import BadRequest, Request, State
from jaxdp.engine.sched.rows import RankRows, sampling_row

log = logging.getLogger("jaxdp.scheduler")


@dataclasses.dataclass
class SchedulerConfig:
    chunk_size: int  # prompt tokens per step on this rank
    max_running: int
    context_len: int
    conservativeness: float = 1.0  # reservation for future tokens (x0.3 under attention DP)
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 1 << 30  # sampling clamps top_k to it
    seed: int = 0  # the engine's: a request without a seed samples with one made from it and its rid
    penalty_slots: int = 0  # slots of the rank's penalty state on the device (requests with penalties at once)


def output_limit(cfg: SchedulerConfig, req: Request) -> int:
    """Output tokens the request may have in all: max_new_tokens, or what the context leaves."""
    return min(req.params.max_new_tokens, cfg.context_len - len(req.prompt_ids))


def check_admission(cfg: SchedulerConfig, num_pages: int, page_size: int, req: Request) -> None:
    """Refuse at once what a rank can never serve: the prompt past the context (capped by the pool), or the
    prompt's pages and its output's reservation past the whole pool. The one admission rule: a rank's, and an
    engine client's before it sends a request (`jaxdp.engine.ipc.client`)."""
    n, ctx = len(req.prompt_ids), cfg.context_len
    if n + 1 > ctx:
        raise BadRequest(f"the prompt has {n} tokens but a rank holds at most {ctx} (context length / KV "
                         "pool); shorten the prompt")
    reserve = int(output_limit(cfg, req) * cfg.conservativeness)
    pages = -(-n // page_size) + -(-reserve // page_size)
    if pages > num_pages:
        raise BadRequest(f"the prompt's {n} tokens and the {reserve} tokens reserved for its output need "
                         f"{pages} pages but a rank's KV pool has {num_pages} of {page_size} tokens; shorten the "
                         "prompt or ask for fewer tokens")


PASS_OVER_LIMIT = 16  # requests that cannot fit now tried per step: a long queue costs a bounded scan


class Scheduler:
    """A rank's scheduler; `disagg`: prefill/decode disaggregation's policy (`jaxdp.engine.sched.policy`), and
    `lookahead`: slots past a prompt's end its last chunk holds (speculative decoding's draft positions)."""

    def __init__(self, rank: int, pool: PagePool, cache: PrefixCache, cfg: SchedulerConfig, rows: RankRows,
                 disagg: Disagg = NO_DISAGG, lookahead: int = 0):
        self.rank, self.pool, self.cache, self.cfg, self.rows = rank, pool, cache, cfg, rows
        self.disagg, self.lookahead = disagg, lookahead
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # by rid, in the order they started decoding
        self.retracted_total = 0
        self._finishing = 0  # prompts whose reading the last plan finishes (they leave `waiting` at commit)
        self.top_logprob_requests = 0  # live requests asking for top logprobs or token ids (computed only then)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.kv_waiting: dict[str, Request] = {}  # disaggregated decode: requests waiting for pages, then for KV
        self.free_slots = list(range(cfg.penalty_slots - 1, -1, -1))  # penalty slots (lowest first); the step side
        # keeps their state on the device (`jaxdp.engine.step.controls`)
        self.controlled = 0  # live requests with a logit bias or penalties (the step's sampling controls)
        self.constrained = 0  # running requests with a grammar (the step books the last one before planning)
        self.joined_to_fill: list[Request] = []  # disaggregated decode: joined with a penalty slot, not yet filled

    # ---- admission -----------------------------------------------------------------------------
    def limit(self, req: Request) -> int:
        return output_limit(self.cfg, req)

    def add(self, req: Request) -> None:
        self.top_logprob_requests += req.params.wants_top
        self.controlled += req.params.has_controls
        if self.disagg.reads_elsewhere(req):  # its prompt is read on a prefill server
            self.kv_waiting[req.rid] = req
            return
        self.waiting.append(req)

    def controls(self, plan: RankPlan | None) -> int:
        """The sampling controls the rank's plan needs (bits: 1 a live request has a logit bias or penalties, 2 a
        request of the plan has a grammar), which the rank proposes for the step."""
        if plan is None:
            return 0
        grammar = self.constrained or any(r.matcher is not None for r in plan.reqs[: len(plan.pieces)])
        return int(self.controlled > 0) | (2 if grammar else 0)

    @property
    def num_tokens(self) -> int:
        """Tokens held by this rank's requests (the total_tokens balancing signal)."""
        running, waiting = list(self.running.values()), [*self.waiting, *self.kv_waiting.values()]  # snapshots
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
                pool, cache = self.pool, self.cache
                running, waiting = len(self.running), len(self.waiting) + len(self.kv_waiting)
                out = {
                    "num_running_reqs": running, "num_queue_reqs": waiting, "num_reqs": running + waiting,
                    "num_tokens": self.num_tokens,
                    "num_used_tokens": (pool.num_pages - pool.free) * pool.page_size,
                    "token_usage": self.token_usage,
                    "max_total_num_tokens": pool.num_pages * pool.page_size,
                    "page_size": pool.page_size, "num_pages": pool.num_pages, "free_pages": pool.free,
                    "cached_pages": cache.size,
                    "cache_hit_rate": cache.hit_tokens / cache.queried_tokens if cache.queried_tokens else 0.0,
                    "retracted_reqs": self.retracted_total,
                }
                if (disagg := self.disagg.state(self.rank, list(self.kv_waiting.values()))) is not None:
                    out["disagg"] = disagg
                return out
            except RuntimeError:  # a dict resized mid-read
                continue
        raise RuntimeError("the scheduler kept changing while its state was read")

    def _available(self) -> int:
        return self.pool.free + self.cache.evictable()

    def _reserve(self, req: Request) -> int:
        """Pages held back for a request's future tokens when it is admitted."""
        return self.pool.pages_for(int(max(0, self.limit(req) - len(req.output_ids)) * self.cfg.conservativeness))

    def _reserved_by_running(self) -> int:
        a = self.rows.a
        left = np.where(a.occupied, a.limit - a.n_out, 0).clip(0)
        tokens = (left * self.cfg.conservativeness).astype(np.int64)
        return int((-(-tokens // self.pool.page_size)).sum())

    def _take_pages(self, n: int) -> list[int] | None:
        if n > self.pool.free:
            self.cache.evict(n - self.pool.free)
        return self.pool.alloc(n)

    # ---- picking the next batch ----------------------------------------------------------------
    def schedule(self, allow_new_prompt: bool = True, mixed_chunk: bool = False) -> RankPlan | None:
        """The rank's next batch: prompt chunks first, else a decode of every running request.
        `allow_new_prompt`: False while the prefill delayer holds new prompts back (a prompt already being
        read goes on). `mixed_chunk`: a prompt step carries this rank's decoders too (jaxdp/engine/sched/mixed.py)."""
        self._finishing = 0
        if self.kv_waiting:
            self._allocate_for_kv()
        plan = None
        if self.waiting:
            carry = decoders_to_carry(self.rows, self.cfg.chunk_size) if mixed_chunk else None
            plan = self._schedule_extend(allow_new_prompt, self.cfg.chunk_size - (0 if carry is None else len(carry)))
            if plan is not None and carry is not None and len(carry):
                add_decoders(plan, carry, self.rows, self.pool, self._take_pages)
        if plan is None and self.running:
            plan = self._schedule_decode()
        if self.joined_to_fill and plan is not None:
            self._fill_joined(plan)
        return plan

    @property
    def prompt_ready(self) -> bool:
        """A prompt waits that this rank could read in the next pass, besides those its last plan finishes
        reading (what the prefill delayer announces, between `schedule` and `commit`)."""
        done = self._finishing
        return len(self.waiting) > done and len(self.running) + done < self.cfg.max_running

    def _schedule_extend(self, allow_new_prompt: bool = True, budget: int | None = None) -> RankPlan | None:
        plan = RankPlan("extend", [])
        budget = self.cfg.chunk_size if budget is None else budget
        reserved = self._reserved_by_running()
        passed_over = 0
        failed: list[tuple[Request, str]] = []
        for req in self.waiting:  # (only this thread changes the queue, and not in this loop)
            if budget <= 0 or passed_over >= PASS_OVER_LIMIT or \
                    len(self.running) + len(plan.reqs) >= self.cfg.max_running:
                break
            if self._available() < reserved:
                break  # the pool is short of the running requests' reservation: nothing fits now
            if not allow_new_prompt and not req.pages:
                continue  # the prefill delayer holds new prompts back (one being read goes on)
            fresh = not req.pages
            if fresh and req.params.grammar is not None and req.matcher is None:  # admitted once compiled
                if (why := self._grammar_ready(req)) is not None:
                    if why:
                        failed.append((req, why))
                    passed_over += 1
                    continue
            if fresh and req.params.has_penalties and req.penalty_slot < 0 and not self.free_slots:
                passed_over += 1  # every penalty slot is taken: it waits for one
                continue
            if fresh:
                reuse = req.num_tokens - 1
                if req.prompt_logprobs_left:  # SGLang's rule: recompute from logprob_start_len on (its row before)
                    reuse = min(reuse, max(req.params.logprob_start_len - 1, 0))
                shared = self.cache.match(req.all_ids[:reuse])
                req.pages, req.shared_pages = shared, len(shared)
                req.computed = req.scheduled = len(shared) * self.pool.page_size
                if not req.output_ids:
                    req.cached_tokens = req.computed
            n = min(budget, req.num_tokens - req.scheduled)
            end = req.scheduled + n + (self.lookahead if req.scheduled + n == req.num_tokens else 0)
            need = min(self.pool.pages_for(end), self.rows.pages_per_seq) - len(req.pages)
            reserve = self._reserve(req) if req.scheduled + n == req.num_tokens else 0
            if need + reserve > self._available() - reserved or (pages := self._take_pages(need)) is None:
                if fresh:  # give the prefix back; try again on a later step
                    self.cache.unlock(req.pages[: req.shared_pages])
                    req.pages, req.shared_pages, req.computed, req.scheduled = [], 0, 0, 0
                passed_over += 1
                continue  # it cannot fit now: the ones behind it may
            req.pages += pages
            if req.params.has_penalties and req.penalty_slot < 0:
                req.penalty_slot = self.free_slots.pop()
                plan.inits.append(req)  # (filled from its prompt and output on the device before it samples)
            eos = self.eos_token_ids
            plan.sampling.append(sampling_row(req.params, req.rid, self.cfg.seed, self.cfg.vocab_size, eos,
                                              req.penalty_slot))
            plan.reqs.append(req)
            plan.pieces.append(Piece(req.all_ids[req.scheduled: req.scheduled + n], req.scheduled, req.pages))
            budget -= n
            reserved += reserve
            self._finishing += req.scheduled + n == req.num_tokens
        for req, why in failed:
            req.error = why
            self.finish(req, "abort", time.perf_counter())
        return plan if plan.reqs else None

    @staticmethod
    def _grammar_ready(req: Request) -> str | None:
        """None once the request's grammar is compiled (its matcher set); else "" while it compiles, or why it
        failed."""
        fut = req.grammar_future
        if fut is None or not fut.done():
            return ""
        if (e := fut.exception()) is not None:
            return f"its grammar could not be used: {e}"
        req.matcher = fut.result()
        return None

    def _allocate_for_kv(self) -> None:
        """Decode side of disaggregation: pages for the prompts whose KV another server reads, in arrival order,
        each with its output's reservation, as a prompt would be admitted; then its KV is fetched. A request with a
        grammar waits for its matcher first, one with penalties for a penalty slot (held while its KV travels), as
        a prompt would; the ones behind it go on meanwhile."""
        reserved = self._reserved_by_running()
        failed: list[tuple[Request, str]] = []
        for req in self.kv_waiting.values():
            if req.pages:
                continue  # its KV is on its way
            if len(self.running) + sum(bool(r.pages) for r in self.kv_waiting.values()) >= self.cfg.max_running:
                break
            if req.params.grammar is not None and req.matcher is None and (why := self._grammar_ready(req)) is not None:
                if why:
                    failed.append((req, why))
                continue
            if req.params.has_penalties and not self.free_slots:
                continue
            need, reserve = self.pool.pages_for(len(req.prompt_ids)), self._reserve(req)
            if need + reserve > self._available() - reserved or (pages := self._take_pages(need)) is None:
                break  # in order: the next ones wait too
            req.pages = pages
            if req.params.has_penalties:
                req.penalty_slot = self.free_slots.pop()
            reserved += reserve
            self.disagg.fetch(self.rank, req)
        for req, why in failed:
            req.error = why
            self.finish(req, "abort", time.perf_counter())

    def join_prefilled(self, req: Request, token: int, logprob: float, now: float) -> None:
        """Decode side: a request whose prompt's KV was written into its pages starts decoding from the first
        token the prefill server sampled (unless that token already ends it): its grammar's matcher advanced past
        that token, its penalty slot filled from its prompt and that token before it samples (`joined_to_fill`,
        given to the next plan that holds it), as if it had read its prompt here."""
        del self.kv_waiting[req.rid]
        req.computed = req.scheduled = len(req.prompt_ids)
        req.output_ids = [int(token)]
        if req.params.return_logprob:
            req.output_logprobs.append(float(logprob))
        req.first_token_at = now
        p = req.params
        # (a request the first token ends never joins `running`: finish would take it out of a row it never had)
        if req.matcher is not None and not req.matcher.accept(int(token)):
            req.error = f"the prefill server's first token {token} does not follow the request's grammar"
            self.finish(req, "abort", now)
        elif (reason := finish_reason(req, int(token), 1, self.limit(req), self.eos_token_ids)) is not None:
            self.finish(req, reason, now)
        else:
            req.state = State.RUNNING
            self.running[req.rid] = req
            self.constrained += req.matcher is not None
            self.rows.join(req, int(token), -1, self.limit(req),
                           sampling_row(p, req.rid, self.cfg.seed, self.cfg.vocab_size, self.eos_token_ids,
                                        req.penalty_slot))
            if req.penalty_slot >= 0:
                self.joined_to_fill.append(req)
            if req.on_update:
                req.on_update(req)

    def _fill_joined(self, plan: RankPlan) -> None:
        """The joined requests this plan samples get their penalty slot filled by its step (`plan.inits`); one
        retracted or finished meanwhile no longer holds its slot (it takes another when it resumes)."""
        rids = {r.rid for r in plan.reqs}
        keep = []
        for req in self.joined_to_fill:
            if req.penalty_slot < 0 or req.finished:
                continue
            (plan.inits if req.rid in rids else keep).append(req)
        self.joined_to_fill = keep

    def _schedule_decode(self) -> RankPlan | None:
        rows = self.rows.decodable()
        retracted = False
        for row in self.rows.needing_page(rows):  # about one request in page_size per step
            req = self.rows.reqs[row]
            if req is None or req.rid not in self.running:  # retracted below for an earlier one
                continue
            need = self.pool.pages_for(self.rows.a.length[row]) - len(req.pages)
            while (pages := self._take_pages(need)) is None and self.running:
                self._retract(next(reversed(self.running.values())))
                retracted = True
                if req.rid not in self.running:
                    break
            if req.rid in self.running and pages is not None:
                self.rows.add_pages(req, pages)
        if retracted:
            rows = self.rows.decodable()
        if not len(rows):
            return None
        reqs = self.rows.reqs
        return RankPlan("decode", [reqs[i] for i in rows], rows=rows)

    def _retract(self, req: Request) -> None:
        """Back to the front of the queue; its full pages go to the prefix cache, so resuming is cheap (its penalty
        slot is given back: it takes one again, filled from its tokens, when it resumes)."""
        del self.running[req.rid]
        self.rows.leave(req)
        self._release(req)
        self.cache.insert(req.all_ids[: req.computed], req.pages, req.shared_pages)
        req.pages, req.shared_pages, req.computed, req.scheduled = [], 0, 0, 0
        req.state = State.WAITING
        req.retractions += 1
        self.retracted_total += 1
        self.waiting.appendleft(req)
        log.info("rank %d: retracted request %s (KV pool full); it resumes when pages free up", self.rank, req.rid)

    # ---- the step is queued ----------------------------------------------------------------------
    def commit(self, plan: RankPlan, step: int) -> None:
        """Step `step` runs this plan: its sampled tokens are in flight (markers -1-j in output_ids), prompt
        chunks are scheduled, and requests whose prompt it finishes start decoding in a row of the batch."""
        plan.step = step
        m, n = len(plan.pieces), len(plan.reqs)
        if not m:  # a decode
            plan.out_pos = self.rows.sampled(plan.rows, step)
            plan.sampled_rows = plan.rows
            plan.ends = self.rows.a.length[plan.rows] - 1
            for j, req in enumerate(plan.reqs):
                req.output_ids.append(-1 - j)
            return
        plan.out_pos, plan.sampled_rows = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        plan.ends = np.zeros(n, np.int64)
        if n > m:  # a mixed chunk: its decoders, sequences m.. of the step, as in a decode
            plan.out_pos[m:] = self.rows.sampled(plan.rows, step, first=m)
            plan.sampled_rows[m:] = plan.rows
            plan.ends[m:] = self.rows.a.length[plan.rows] - 1
            for j in range(m, n):
                plan.reqs[j].output_ids.append(-1 - j)
        for j, (req, piece) in enumerate(zip(plan.reqs[:m], plan.pieces, strict=True)):
            req.scheduled = plan.ends[j] = piece.start + len(piece.tokens)
            if req.scheduled < req.num_tokens:
                continue  # a prompt chunk that samples nothing
            self.waiting.remove(req)
            req.state = State.RUNNING
            self.running[req.rid] = req
            self.constrained += req.matcher is not None
            plan.out_pos[j] = len(req.output_ids)
            req.output_ids.append(-1 - j)
            plan.sampled_rows[j] = self.rows.join(req, -1 - j, step, self.limit(req), plan.sampling[j])

    # ---- booking the results -------------------------------------------------------------------
    def book(self, plan: RankPlan, tokens: np.ndarray, logprobs: np.ndarray | None, now: float) -> list[Request]:
        """Put one step's sampled tokens in place of their markers; returns the requests that finished.

        The step has run, so its latents are in the cache (`computed`). With the overlap the next step was
        already planned: a request that finishes here may have a row in it, whose token is dropped when that
        step is booked."""
        m = len(plan.reqs)
        tokens = tokens[:m]
        self.rows.booked(plan.sampled_rows, plan.step, tokens)
        toks, lps = tokens.tolist(), logprobs[:m].tolist() if logprobs is not None else None
        out_pos, ends = plan.out_pos.tolist(), plan.ends.tolist()
        done = []
        for i, req in enumerate(plan.reqs):
            if req.finished:  # aborted, or finished by an earlier step meanwhile
                continue
            if ends[i] > req.computed:
                req.computed = ends[i]
            pos = out_pos[i]
            if pos < 0:  # a prompt chunk
                continue
            tok = req.output_ids[pos] = toks[i]
            if req.params.return_logprob and lps is not None:
                req.output_logprobs.append(lps[i])
            if req.first_token_at is None:
                req.first_token_at = now
            if req.matcher is not None and not req.matcher.accept(tok):  # (the mask allows only what it accepts)
                req.error = f"token {tok} does not follow the request's grammar; the request ends there"
                reason = "abort"
            else:
                reason = finish_reason(req, tok, pos + 1, self.limit(req), self.eos_token_ids)
            if reason is None:
                if req.on_update:
                    req.on_update(req)
                continue
            del req.output_ids[pos + 1:]  # tokens of a step planned before this one was booked
            self.finish(req, reason, now)
            done.append(req)
        return done

    def finish(self, req: Request, reason: str, now: float) -> None:
        if self.running.pop(req.rid, None) is not None:
            self.rows.leave(req)
            self._release(req)
        elif req.penalty_slot >= 0:  # (admitted, its prompt still being read)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv_waiting.pop(req.rid, None)
        req.output_ids = list(req.done_ids)  # an abort may leave tokens in flight: they are dropped
        self.disagg.finished(self.rank, req, reason)  # (prefill side: its KV is read from the pages before they go)
        if req.pages:
            self.cache.insert(req.all_ids[: req.computed], req.pages, req.shared_pages)
            req.pages = []
        req.state, req.finish_reason, req.finished_at = State.FINISHED, reason, now
        self.top_logprob_requests -= req.params.wants_top
        self.controlled -= req.params.has_controls
        if req.on_update:
            req.on_update(req)

    def _release(self, req: Request) -> None:
        """A request leaves the running batch (or its admission): its penalty slot goes back, and it no longer
        holds the steps to their order (a grammar)."""
        if req.penalty_slot >= 0:
            self.free_slots.append(req.penalty_slot)
            req.penalty_slot = -1
        if req.matcher is not None and req.state == State.RUNNING:
            self.constrained -= 1

    def abort(self, rid: str, now: float) -> Request | None:
        req = self.running.get(rid) or self.kv_waiting.get(rid) or next((r for r in self.waiting if r.rid == rid), None)
        if req is not None:
            self.finish(req, "abort", now)
        return req
