"""`jaxdp.Engine`: the schedulers of all DP ranks of this host, driven by one loop, over one StepRunner.

Each iteration (`step`): every rank's scheduler picks its batch; the ranks agree (`agree_on_step`: rows
per rank, the decode-bucket vote, "any rank reads a prompt"); when a prompt is read anywhere, decoding
ranks present their batch as one-token extends so all ranks share one extend step (the relabeling);
ranks without work run an idle (all-padding) batch while any rank has work; nothing runs when all are
idle. The compiled step is chosen from the busiest rank; tokens are sampled on the device.

Use it offline (`generate`) or from a server (`start`, then `submit` / `stream` from other threads).

Across several nodes (`hosts`, see `jaxdp.engine.hosts` and `.nodes`) every node runs an Engine over the mesh; its
loop schedules only its own ranks, the agreement's exchange carries the other nodes' proposals, and node 0
(the one with the HTTP server) keeps a stand-in for each request it sent to another node, which the
exchange keeps up to date with that node's tokens.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import numpy as np

from jaxdp.batch import SAMPLING_KEYS, STEP_FIELDS
from jaxdp.engine.buckets import Buckets
from jaxdp.engine.controller import Controller
from jaxdp.engine.delayer import PrefillDelayer
from jaxdp.engine.hosts import HostExchange, PeerFailure, PeerStopped, first_line
from jaxdp.engine.logprobs import book_prompt_logprobs, chosen_ids, prompt_inputs, prompt_logprobs
from jaxdp.engine.nodes import NodeFlush, NodeLink, flush_ranks
from jaxdp.engine.options import EngineConfig
from jaxdp.engine.plan import RankPlan, rank_proposals
from jaxdp.engine.pool import PagePool, PrefixCache
from jaxdp.engine.request import Request, SamplingParams, new_request
from jaxdp.engine.rows import RankRows, RowArrays, plan_arrays
from jaxdp.engine.sampling import book_top_logprobs, sample_tokens, top_logprobs
from jaxdp.engine.scheduler import Scheduler, SchedulerConfig
from jaxdp.engine.setup import compile_steps, find_tokenizer, make_runner
from jaxdp.engine.stats import InFlight, StepStats, compiles_on_this_thread, compiles_total
from jaxdp.engine.streams import Result, Wakeups
from jaxdp.engine.threads import start_thread
from jaxdp.engine.updates import end as end_request
from jaxdp.parallel.places import LocalExchange, agree_on_step
from jaxdp.parallel.step import StepRunner, StepShape

log = logging.getLogger("jaxdp.engine")


class EngineFailed(Exception):
    """The engine cannot serve any more (another node died); the message says what happened (HTTP 503)."""


class Engine:
    def __init__(self, model: str | StepRunner = "default", mesh: str = "dp=1", config: EngineConfig | None = None,
                 *, dtype: str = "float32", tokenizer=None, warmup: bool = True, attention_backend: str | None = None,
                 moe_runner_backend: str | None = None, quantization: str | None = None, seed: int = 0,
                 hosts: HostExchange | None = None):
        """`model`: a checkpoint directory, "default" (the embedded model), a preset (random weights, seeded)
        or a ready StepRunner (or a stand-in of its interface: `jaxdp.bench.engine.HostOnlyRunner`). `mesh`: a
        --mesh spec (dp=8, dp=2,tp=4, dp=8,moe=ep, a meshes/ preset).
        `hosts`: the exchange with the other nodes when the mesh spans several (then `model` is a StepRunner
        over the whole mesh, and this engine schedules the ranks of its own node)."""
        self.cfg = config or EngineConfig()
        self.runner = runner = model if not isinstance(model, str) else make_runner(
            model, mesh, self.cfg, dtype, attention_backend, seed, quantization, moe_runner_backend)
        self._sample = getattr(runner, "sample_tokens", sample_tokens)  # a stand-in runner samples itself
        self.model_cfg, self.layout = runner.cfg, runner.layout
        self.tokenizer = tokenizer if tokenizer is not None else find_tokenizer(model)
        dp, c = self.layout.dp, self.cfg
        if c.num_pages > runner.num_pages:
            raise ValueError(f"num_pages {c.num_pages} exceeds the step runner's pool of {runner.num_pages}")
        if c.page_size != runner.page_size:  # the slots the host computes would land in the wrong places
            raise ValueError(f"page_size {c.page_size} differs from the step runner's {runner.page_size}; build "
                             "both from one EngineConfig")
        self.max_running_per_rank = max(1, c.max_running_requests // dp)
        chunk = max(1, c.chunked_prefill_size // dp)
        if dp > 1:
            log.info("DP attention is enabled. chunked prefill size is adjusted from %d to %d.",
                     c.chunked_prefill_size, chunk)
        conservativeness = c.schedule_conservativeness * (0.3 if dp > 1 else 1.0)
        self.context_len = context_len = min(c.context_length or self.model_cfg.max_position_embeddings,
                                             c.num_pages * c.page_size)
        self.pages_per_seq = -(-context_len // c.page_size)
        sched_cfg = SchedulerConfig(chunk, self.max_running_per_rank, context_len, conservativeness,
                                    self.model_cfg.eos_token_ids, self.model_cfg.vocab_size, c.seed)
        self.rows = RowArrays.zeros(dp, self.max_running_per_rank, self.pages_per_seq)  # the persistent batch
        self.schedulers = []
        for r in range(dp):
            pool = PagePool(c.num_pages, c.page_size)
            self.schedulers.append(Scheduler(r, pool, PrefixCache(pool, c.enable_prefix_cache), sched_cfg,
                                             RankRows(self.rows.rank(r), c.page_size)))
        self.controller = Controller(dp, c.load_balance_method)  # (a server's ReplicaSet pins ranks itself)
        runner.ensure_token_carry(max(self.max_running_per_rank, *(c.decode_buckets or [1])))  # tokens read back
        self.buckets = Buckets.make(self.max_running_per_rank, chunk, dp, c.decode_buckets, c.extend_buckets,
                                    c.max_len_extend_rows).with_pages(self.pages_per_seq, c.page_size)
        self.stats = StepStats(dp)
        self.delayer = PrefillDelayer(c.prefill_delayer, dp) if c.prefill_delayer else None
        self.hosts = hosts
        self.exchange = hosts if hosts is not None else LocalExchange()
        self.local_ranks = hosts.local_ranks() if hosts is not None else range(dp)
        self.link = NodeLink(self, hosts) if hosts is not None else None  # what rides on the exchange
        self.failed: str | None = None  # why the engine stopped serving (another node failed)
        self._fail_lock = threading.Lock()
        self.blocked: tuple[float, str] | None = None  # (since, what): a wait on another node in progress
        self._inflight: InFlight | None = None
        self.wakeups = Wakeups()  # the streams' event loops, woken once per step
        self._steps = itertools.count()
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.requests: dict[str, Request] = {}
        self._requests_limit = 4096  # past this many, finished requests are forgotten
        self.compiles_at_warmup = 0
        self.prompt_logprob_steps = 0  # steps that returned every row's logits (a request asked for prompt logprobs)
        if warmup and not c.disable_cuda_graph:
            self.warmup()

    # ---- start-up ------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every step shape ahead of time (the stand-in for CUDA graph capture)."""
        compile_steps(self.runner, self._sample, self.buckets, self.layout.dp, self.model_cfg.vocab_size)
        self.compiles_at_warmup = compiles_total()

    # ---- requests ------------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int] | str, params: SamplingParams | None = None, *,
                     rid: str | None = None, rank: int | None = None) -> Request:
        """A validated request (token ids, or text when the model has a tokenizer) on a rank: `rank`, or the
        controller's choice (then it counts in the controller's ledger; a caller that pins ranks, such as
        the server's ReplicaSet, keeps its own); raises BadRequest."""
        if self.failed:
            raise EngineFailed(self.failed)
        rid = rid or f"req-{next(self._ids)}"
        self.controller.check_rid(rid)
        req = new_request(rid, prompt_ids, params, tokenizer=self.tokenizer, vocab_size=self.model_cfg.vocab_size,
                          check=self.schedulers[0].check)  # (every rank of an engine has the same pool and context)
        req.rank = req.dp_rank = self.controller.choose(rank)
        if rank is None:
            self.controller.add(req, req.rank)
        return req

    def submit(self, req: Request) -> Request:
        """Queue a request made by `make_request` (thread-safe); the loop admits it on its next iteration."""
        req.submitted = True
        self._inbox.put(("add", req))
        self._wake.set()
        return req

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))
        self._wake.set()

    def _drain_inbox(self) -> None:
        if len(self.requests) > self._requests_limit:  # forget finished ones (their owners hold them)
            keep = self.link.origin if self.link else {}  # finished, but not yet reported to node 0
            self.requests = {rid: r for rid, r in self.requests.items() if not r.finished or rid in keep}
            self._requests_limit = max(4096, 2 * len(self.requests))  # amortised: not every step past 4096 live
        while True:
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            now = time.perf_counter()
            if cmd == "add":
                if arg.rank not in self.local_ranks:  # node 0: another node's rank
                    self.link.forward(arg)
                    continue
                self.schedulers[arg.rank].add(arg)
                self.requests[arg.rid] = arg
            elif cmd == "abort":
                req = self.requests.get(arg)
                if req is not None and not req.finished:
                    if req.rank in self.local_ranks:
                        self.schedulers[req.rank].abort(arg, now)
                    else:
                        self.link.forward_abort(req, now)
            elif cmd == "flush":  # several nodes: every node's ranks, the others' through the exchange
                if self.link:
                    self.link.flush(arg)
                else:
                    arg.set_result([flush_ranks(self.schedulers, self.local_ranks, 0, self.busy)])

    @property
    def busy(self) -> bool:
        return any(s.running or s.waiting for s in self.schedulers)

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration of the loop; False when every rank is idle and nothing is in flight.

        With `overlap`, step N+1 is planned and queued on the device before step N's tokens are read
        back: rows whose input token is still in flight carry a marker (-1-j: the j-th token step N
        sampled on this rank) that the step resolves on the device, and step N is booked while N+1 runs."""
        self._drain_inbox()
        t0 = time.perf_counter()
        d = self.delayer  # prefill delayer: a new prompt waits while the last agreement says so
        plans: list[RankPlan | None] = [s.schedule(d is None or d.may_start_prompt(r), self.cfg.enable_mixed_chunk)
                                        for r, s in enumerate(self.schedulers)]
        ta = time.perf_counter()
        self.blocked = (ta, "exchanging the step's proposals")
        message = self.link.message() if self.link else {}
        if d:  # the delayer's numbers ride on the exchange; every node decides the next pass from all of them
            d.post(message, [self.schedulers[r] for r in self.local_ranks])
        mine = self._proposals(plans)
        proposals, messages = self.exchange.exchange(mine, message)
        self.blocked = None
        if self.link:
            self.link.receive(messages)
        if d:
            d.read(messages)
        agreement = agree_on_step(proposals)
        agree_s = time.perf_counter() - ta
        if not agreement.run:
            if self._inflight is None:
                return bool(d and d.pass_again)  # a prompt announced or held: the next pass decides, at once
            self._book(self._inflight, t0)
            self._inflight = None
            return True
        rows = list(agreement.rows_per_rank)  # every node's ranks (only this node's have plans here)
        shape = self._shape_for(rows, agreement)
        compiles_before = compiles_on_this_thread()
        step = next(self._steps)
        try:
            current = self._queue(plans, shape, rows, agreement, t0, agree_s)
        except Exception:
            if self.link:  # a step across the nodes: every node must run it; the loop fails the engine
                raise
            # not a user error (requests are validated, sampling clamps): find the request that fails it
            log.exception("engine step failed; retrying its requests in smaller steps to find the one that fails")
            if self._inflight is not None:
                self._book(self._inflight, time.perf_counter())
                self._inflight = None
            self._isolate(plans)
            return True
        for r, plan in enumerate(plans):
            if plan:
                self.schedulers[r].commit(plan, step)
        previous, self._inflight = self._inflight, current
        if previous is not None:
            self._book(previous, time.perf_counter())
        if current is not None and not self.cfg.overlap:
            self._book(current, time.perf_counter())
            self._inflight = None
        self.stats.compiles_in_steps += compiles_on_this_thread() - compiles_before
        return True

    def _shape_for(self, rows: list[int], agreement) -> StepShape:
        """The compiled step of this batch; the every-row variant when a prompt read in it asks for logprobs."""
        if agreement.any_prompt_logprobs:
            self.prompt_logprob_steps += 1
            return self.buckets.prompt_logprob_shape()
        return self.buckets.shape_for(rows, agreement)

    def _queue(self, plans: list[RankPlan | None], shape: StepShape, rows: list[int], agreement,
               t0: float, agree_s: float) -> InFlight:
        """Build the step's arrays from the plans and queue it (and its sampling) on the device."""
        c = self.cfg
        out = plan_arrays(plans, self.rows, shape, c.page_size, c.num_pages * c.page_size)
        out["rows_R"] = np.asarray(rows, np.int32)
        params = [self.runner.put(out[k]) for k in SAMPLING_KEYS]
        asks = prompt_inputs(plans, out) if shape.all_logits else None  # (turns logits_idx_B into every row)
        t1 = time.perf_counter()
        prev = self._inflight.tokens if self._inflight is not None else None
        self.runner.compile(shape)  # (a no-op after warm-up) not counted as waiting for the other nodes
        self.blocked = (time.perf_counter(), "queueing a step that runs on every node")  # may wait for the last
        logits, _ = self.runner.run(shape, {k: out[k] for k in (*STEP_FIELDS, "rows_R")}, prev_tokens=prev)
        prompt = None
        if asks is not None:  # every row's logits: the sampler gets each sequence's row, the rest is reduced here
            logits, *prompt = prompt_logprobs(logits, *(self.runner.put(a) for a in asks))
        tokens, logprobs = self._sample(logits, *params, width=self.runner.token_carry)
        self.blocked = None
        t2 = time.perf_counter()  # top logprobs: on every node together (the agreement says), or on none
        top = top_logprobs(logits, self.runner.put(chosen_ids(plans, shape.num_seqs))) if agreement.any_top else None
        return InFlight(plans, tokens, logprobs, shape, rows, agreement, self.runner.last_account,
                        host_s=t1 - t0, dispatch_s=t2 - t1, agree_s=agree_s, top=top, prompt=prompt)

    def _proposals(self, plans: list[RankPlan | None]):  # "a request asks for top logprobs" is a count per rank
        tops = [s.top_logprob_requests > 0 for s in self.schedulers]
        return rank_proposals(plans, self.buckets.decode[-1], self.rows.num_pages, tops)

    def _isolate(self, plans: list[RankPlan | None]) -> None:
        """A step failed: run its plans again as steps of their own, each rank's alone, then halves of a plan
        that fails, until the request that fails is alone; it fails, the others run (and are booked) as usual.
        Only this node's ranks (a step across nodes does not get here)."""
        todo = [(r, p) for r, p in enumerate(plans) if p]
        while todo:
            r, plan = todo.pop()
            plan = plan.unfinished()
            if plan is None:
                continue
            only: list[RankPlan | None] = [None] * self.layout.dp
            only[r] = plan
            agreement = agree_on_step(self._proposals(only))
            rows = list(agreement.rows_per_rank)
            shape = self._shape_for(rows, agreement)
            step, t0 = next(self._steps), time.perf_counter()
            try:
                f = self._queue(only, shape, rows, agreement, t0, 0.0)
            except Exception as e:
                if len(plan.reqs) > 1:
                    todo += [(r, half) for half in plan.halves()]
                    continue
                req = plan.reqs[0]
                log.error("request %s fails the engine step (%s); it alone is aborted", req.rid, first_line(e, 160))
                req.error = f"this request failed the engine step ({first_line(e, 120)}); see the server log"
                self.schedulers[r].finish(req, "abort", time.perf_counter())
                continue
            self.schedulers[r].commit(plan, step)
            self._book(f, time.perf_counter())

    def _book(self, f: InFlight, t_start: float) -> None:
        t0 = time.perf_counter()
        self.blocked = (t0, "waiting for a step that runs on every node")
        tokens = self.runner.local_values(f.tokens)  # waits for the step to finish
        logprobs = self.runner.local_values(f.logprobs)
        self.blocked = None
        t1 = time.perf_counter()
        top = None if f.top is None else [self.runner.local_values(a) for a in f.top]
        prompt = None if f.prompt is None else [self.runner.local_values(a) for a in f.prompt]
        for r, plan in enumerate(f.plans):
            if plan:
                if prompt is not None and plan.pieces:
                    book_prompt_logprobs(plan, *(a[r] for a in prompt))
                if top is not None:
                    book_top_logprobs(plan.reqs, plan.out_pos >= 0, *(a[r] for a in top))
                self.schedulers[r].book(plan, tokens[r], logprobs[r], t1)
        t2 = time.perf_counter()
        self.stats.record(f.shape, f.rows, f.agreement, f.account, host_s=f.host_s + (t2 - t1),
                          dispatch_s=f.dispatch_s, wait_s=t1 - t0, agree_s=f.agree_s, compiled=0,
                          new_tokens=sum(p.num_sampled for p in f.plans if p))

    def run_until_idle(self, max_steps: int | None = None) -> int:
        n = 0
        while self.step():
            n += 1
            if max_steps is not None and n >= max_steps:
                break
        return n

    # ---- offline use ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 *, ranks: list[int | None] | None = None) -> list[Request]:
        """Run prompts (token ids) to completion and return the finished requests, in order."""
        if self._thread is not None:
            raise RuntimeError("generate() runs the loop itself; use submit()/stream() while the loop runs")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.submit(self.make_request(p, sp, rank=(ranks[i] if ranks else None)))
                for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
        while not all(r.finished for r in reqs):
            if not self.step() and not all(r.finished for r in reqs):
                self._drain_inbox()
        return reqs

    # ---- background loop and streaming -----------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            if self.hosts is not None:  # nodes finish compiling at different times: meet before the first step
                self.hosts.barrier("ready", self.hosts.init_timeout_s)
            self._stop = False
            self._thread = start_thread(self._loop, "jaxdp-engine")
            if self.link:
                self.link.start_watchdog()

    def _loop(self) -> None:
        while not self._stop:
            try:
                ran = self.step()
            except PeerStopped as e:
                self.fail(str(e), level=logging.INFO)
                return
            except PeerFailure as e:
                self.fail(str(e))
                return
            except Exception as e:
                if self.link and self.failed is None:  # a collective with a dead node fails here
                    self.fail(f"a step across the nodes failed ({first_line(e, 120)}); {self.link.suspects()} died")
                    return
                # a bug outside the step's own requests (a failed step is isolated in `step`): fail loudly
                log.exception("the engine loop failed; aborting all requests")
                self._inflight = None  # its requests are aborted below; never booked again
                now = time.perf_counter()
                for s in self.schedulers:
                    for req in [*s.running.values(), *s.waiting]:
                        req.error = "internal error in the engine loop; see the server log"
                        s.finish(req, "abort", now)
                ran = False
            self.wakeups.deliver()
            if self.failed:
                return
            if not ran and (self.hosts is None or self.hosts.node_rank == 0):
                # idle: wait for a request (other nodes wait inside the next exchange, for node 0)
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        if self.link and self.link.is_node_0 and not self.failed:
            self.link.say_stop()

    # ---- failure (several nodes) ------------------------------------------------------------------
    def fail(self, message: str, level: int = logging.ERROR) -> None:
        """Stop serving: every unfinished request ends with the message, new ones get it (HTTP 503)."""
        with self._fail_lock:  # the watchdog thread and the loop may both get here
            if self.failed:
                return
            self.failed = message
        log.log(level, "%s", message if level != logging.ERROR else f"{message}; this engine stops serving")
        now = time.perf_counter()
        for req in list(self.requests.values()):
            if not req.finished:
                req.error_status = 503
                end_request(req, "abort", message, now)
        self.wakeups.deliver()
        self._stop = True
        self._wake.set()

    def rank_state(self, rank: int) -> dict:
        """The scheduler's figures of a rank of this engine (another node's: as of the last exchange)."""
        if rank in self.local_ranks:
            return self.schedulers[rank].state()
        return self.link.remote_state.get(rank) or self.schedulers[rank].state()

    def stream(self, req: Request) -> AsyncIterator[Request]:
        """Yield the request after every new token and once when it finishes (the loop must be running); the
        request is submitted here, and aborted if the caller stops reading."""
        return self.wakeups.stream(req, self.submit, self.abort)

    def flush_cache(self) -> list[NodeFlush] | None:
        """Flush the prefix cache of every rank unless requests run or wait: what each node did, or None when
        not every node answered within 30 s."""
        fut = Result()
        self._inbox.put(("flush", fut))
        self._wake.set()
        if self._thread is None:
            self._drain_inbox()
        return fut.wait()

    @property
    def is_running(self) -> bool:
        """The background loop is alive and serving (what /health reports)."""
        return self._thread is not None and self._thread.is_alive() and not self.failed

    def stop(self) -> None:
        """Stop the background loop (requests in flight stay queued)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def shutdown(self) -> None:
        """Stop the loop and free the weights, caches and compiled steps."""
        self.stop()
        self.runner.close()
