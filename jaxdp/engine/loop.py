"""`jaxdp.Engine`: the schedulers of all DP ranks of this host, driven by one loop, over one StepRunner.

The engine is an `EngineClient` (`jaxdp.engine.ipc.client`): requests are made and checked here (`make_request`),
queued from any thread (`submit`, `abort`, `stream`) into an inbox, and the loop takes them in before each
iteration of the step pipeline (`jaxdp.engine.step.pipeline.StepPipeline`: plan, agree, queue, book). This module
is the loop: the inbox, the thread, the failures that end the engine; the pipeline is the step.

Use it offline (`generate`, or `step` / `run_until_idle`) or from a server (`start`, then `submit` / `stream`
from other threads).

Across several nodes (`hosts`, see `jaxdp.engine.nodes.hosts` and `.nodes`) every node runs an Engine over the mesh;
its loop schedules only its own ranks, the agreement's exchange carries the other nodes' proposals, and node 0
(the one with the HTTP server) keeps a stand-in for each request it sent to another node, which the exchange
keeps up to date with that node's tokens. All of that is behind `jaxdp.engine.nodes.link.Nodes`: on one node
(`OneNode`) neither the loop nor the pipeline has a branch for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import msgspec

from jaxdp.engine.ipc.client import ClientBase, EngineFailed
from jaxdp.engine.ipc.messages import EngineFacts, NodeFlush
from jaxdp.engine.ipc.streams import Result, Wakeups
from jaxdp.engine.ipc.updates import end as end_request
from jaxdp.engine.nodes.hosts import HostExchange, PeerFailure, PeerStopped
from jaxdp.engine.nodes.link import NodeLink, Nodes, OneNode
from jaxdp.engine.options import EngineConfig, ModelOptions
from jaxdp.engine.sched.policy import NO_DISAGG, SpecSwitch
from jaxdp.engine.sched.pool import PagePool, PrefixCache
from jaxdp.engine.sched.request import BadRequest, Grammars, Request, SamplingParams
from jaxdp.engine.sched.rows import RankRows, RowArrays
from jaxdp.engine.sched.scheduler import Scheduler, SchedulerConfig
from jaxdp.engine.setup import compile_steps, find_tokenizer, make_runner
from jaxdp.engine.setup import model_options as model_options_of
from jaxdp.engine.step.buckets import Buckets
from jaxdp.engine.step.controls import SamplingControls
from jaxdp.engine.step.pd_sides import make_disagg
from jaxdp.engine.step.pipeline import PlainStep, StepPipeline
from jaxdp.engine.step.prompt_logprobs import PromptLogprobs
from jaxdp.engine.step.spec import SpecScheduler, VerifyStep, check_speculative
from jaxdp.engine.step.step_stats import compiles_total
from jaxdp.engine.threads import start_thread
from jaxdp.eplb.distribution import RecordOutcome
from jaxdp.eplb.online import Rebalancer
from jaxdp.eplb.recorder import record
from jaxdp.parallel.step import StepRunner

__all__ = ["Engine", "EngineFailed"]

log = logging.getLogger("jaxdp.engine")

PENALTY_SLOTS = 64  # requests with penalties at once per rank (their state: 5 bytes x vocabulary each, on the device)


class Engine(ClientBase):
    def __init__(self, model: str | ModelOptions | StepRunner = "default", mesh: str = "dp=1",
                 config: EngineConfig | None = None, *, tokenizer=None, warmup: bool = True,
                 hosts: HostExchange | None = None, grammars: Grammars | None = None, **model_options):
        """`model`: a ready StepRunner (or a stand-in of its interface: `jaxdp.testing.HostOnlyRunner`),
        or what to build one from: a checkpoint directory, "default" (the embedded model) or a preset (random
        weights, seeded), with `model_options` (`ModelOptions`' fields: dtype, seed, ...), or a ModelOptions.
        `mesh`: a --mesh spec (dp=8, dp=2,tp=4, dp=8,moe=ep, a meshes/ preset). The runner owns the pool's
        page size and page count (`config`'s, when it builds the runner; a ready runner's own otherwise).
        `hosts`: the exchange with the other nodes when the mesh spans several (then `model` is a StepRunner
        over the whole mesh, and this engine schedules the ranks of its own node). `grammars`: the grammar backend
        that compiles a request's grammar into a matcher (`jaxdp.engine.sched.request.Grammars`), None when the
        server has none (a request with a grammar is then refused)."""
        c = config or EngineConfig()
        spec = check_speculative(c)
        if isinstance(model, str | ModelOptions):
            if spec:
                model_options["draft"] = True
            runner = make_runner(model_options_of(model, **model_options), mesh, c.pool_pages, c.pool_page_size)
        elif model_options:
            raise TypeError(f"{', '.join(model_options)}: model options apply when the engine builds its runner, "
                            "not to a ready one")
        else:
            runner = model
            c.check_runner(runner)
            if spec and not getattr(runner, "has_draft", False):
                raise ValueError("--speculative-algorithm needs the model's MTP layer; build the step runner with "
                                 "its draft model (jaxdp.engine.setup.build_runners(..., draft=True))")
        self.runner = runner
        self.tokenizer = tokenizer if tokenizer is not None else find_tokenizer(model)
        self.failed: str | None = None  # why the engine stopped serving (another node failed)
        model_cfg, layout, page_size, num_pages = runner.cfg, runner.layout, runner.page_size, runner.num_pages
        dp = layout.dp
        max_running = max(1, c.max_running_requests // dp)
        chunk = max(1, c.chunked_prefill_size // dp)
        if dp > 1:
            log.info("DP attention is enabled. chunked prefill size is adjusted from %d to %d.",
                     c.chunked_prefill_size, chunk)
        conservativeness = c.schedule_conservativeness * (0.3 if dp > 1 else 1.0)
        context_len = min(c.context_length or model_cfg.max_position_embeddings, num_pages * page_size)
        draft_tokens = spec.num_steps if spec else 0
        # (speculating, a request holds pages 2 x draft_tokens positions past its length: the verify, the drafts)
        pages_per_seq = -(-(context_len + 2 * draft_tokens) // page_size)
        sched_cfg = SchedulerConfig(chunk, max_running, context_len, conservativeness, model_cfg.eos_token_ids,
                                    model_cfg.vocab_size, c.seed, min(max_running, PENALTY_SLOTS))
        self.grammars = grammars
        self.accepts_grammars = grammars is not None
        rows = RowArrays.zeros(dp, max_running, pages_per_seq)  # the persistent batch
        self.nodes: Nodes = NodeLink(self, hosts) if hosts is not None else OneNode(self, dp)
        self.hosts = hosts
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        # the schedulers' policies: disaggregation's side (or none), speculation's switch (shared with the pipeline)
        self.disagg = make_disagg(c.disaggregation, runner, dp, self._post, self.nodes.local_ranks,
                                  hosts.node_rank if hosts is not None else 0)
        switch = SpecSwitch(spec.disable_by_batch_size) if spec else None
        self.schedulers = []
        for r in range(dp):
            pool = PagePool(num_pages, page_size)
            args = (r, pool, PrefixCache(pool, c.enable_prefix_cache), sched_cfg, RankRows(rows.rank(r), page_size),
                    self.disagg or NO_DISAGG)
            self.schedulers.append(SpecScheduler(*args, draft_tokens=draft_tokens, switch=switch) if switch
                                   else Scheduler(*args))
        runner.ensure_token_carry(max(max_running, *(c.decode_buckets or [1])))  # tokens read back
        buckets = Buckets.make(max_running, chunk, dp, c.decode_buckets, c.extend_buckets,
                               c.max_len_extend_rows, draft_tokens,
                               spec.disable_by_batch_size if spec else None, c.tbo_threshold,
                               layout.tp).with_pages(pages_per_seq, page_size)
        # the step kinds: plain (with its prompt-logprob part), and the verify when speculating
        controls = None if hasattr(runner, "sample_tokens") else SamplingControls(  # (a stand-in samples itself)
            runner, dp, sched_cfg.penalty_slots, model_cfg.vocab_size)
        plain = PlainStep(runner, buckets, rows, c.overlap, PromptLogprobs(buckets), controls)
        verify = VerifyStep(runner, buckets, rows, controls) if spec else None
        self.pipeline = StepPipeline(runner, c, self.schedulers, rows, buckets, self.nodes, plain, verify, switch)
        self.facts = EngineFacts(layout, c, buckets, model_cfg, context_len, self.nodes.local_ranks, sched_cfg,
                                 num_pages, page_size, 0, {r: self.schedulers[r].state() for r in range(dp)})
        self._init_intake()
        self._fail_lock = threading.Lock()
        self.wakeups = Wakeups()  # the streams' event loops, woken once per step
        self._thread: threading.Thread | None = None
        self._stop = False
        self.requests: dict[str, Request] = {}
        self._requests_limit = 4096  # past this many, finished requests are forgotten
        # --enable-eplb: online expert rebalancing between steps (its move programs compile here, before serving)
        self.rebalancer = Rebalancer(runner, c.eplb) if c.eplb is not None else None
        if warmup and not c.disable_cuda_graph:
            self.warmup()

    # ---- the pipeline's figures, by the names the server and the tests read -------------------------------
    @property
    def stats(self):
        return self.pipeline.stats

    @property
    def delayer(self):
        return self.pipeline.delayer

    @delayer.setter
    def delayer(self, delayer) -> None:  # (experiments turn it on and off between runs)
        self.pipeline.delayer = delayer

    @property
    def blocked(self) -> tuple[float, str] | None:
        return self.pipeline.blocked

    @property
    def _inflight(self):
        return self.pipeline.inflight

    @property
    def prompt_logprob_steps(self) -> int:
        return self.pipeline.prompt_logprob_steps

    @property
    def compiles(self) -> int:
        return compiles_total()

    # ---- start-up ------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every step shape ahead of time (the stand-in for CUDA graph capture)."""
        compile_steps(self.runner, self.pipeline.sample, self.buckets, self.layout.dp, self.model_cfg.vocab_size,
                      self.pipeline.plain.controls)
        self.compiles_at_warmup = compiles_total()
        self.facts = msgspec.structs.replace(self.facts, compiles_at_warmup=self.compiles_at_warmup)

    # ---- requests (any thread) ---------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request made by `make_request` (thread-safe); the loop admits it on its next iteration."""
        req.submitted = True
        self._inbox.put(("add", req))
        self._wake.set()
        return req

    def abort(self, rid: str) -> None:
        self._post(("abort", rid))

    def _post(self, item: tuple) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _drain_inbox(self) -> None:
        if len(self.requests) > self._requests_limit:  # forget finished ones (their owners hold them)
            keep = self.nodes.keep()  # finished, but not yet reported to node 0
            self.requests = {rid: r for rid, r in self.requests.items() if not r.finished or rid in keep}
            self._requests_limit = max(4096, 2 * len(self.requests))  # amortised: not every step past 4096 live
        while True:
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            now = time.perf_counter()
            if cmd == "add":
                if not self.nodes.send_away(arg):  # (node 0: another node's rank goes there)
                    if arg.params.grammar is not None and arg.grammar_future is None:
                        arg.grammar_future = self._compile_grammar(arg.params.grammar)
                    self.schedulers[arg.rank].add(arg)
                    self.requests[arg.rid] = arg
            elif cmd == "abort":
                req = self.requests.get(arg)
                if not self.nodes.abort_away(arg, now) and req is not None and not req.finished:
                    self.schedulers[req.rank].abort(arg, now)
            elif cmd == "flush":  # every node's ranks (the others' through the exchange)
                self.nodes.flush(arg, self.busy)
            elif cmd == "experts":  # the expert-distribution recorder, between two steps (jaxdp.eplb.recorder)
                action, fut = arg  # (several nodes: every node, after the next exchange)
                self.nodes.expert_record(action, fut)
            elif cmd == "kv":  # disaggregation's decode side: a request's KV arrived (or failed to)
                req, fut = arg
                self.disagg.arrived(self.schedulers[req.rank], req, fut, now)

    def _compile_grammar(self, spec) -> concurrent.futures.Future:
        """The matcher of a request's grammar, compiling off this loop (the loop wakes when it is done)."""
        if self.grammars is None:  # (make_request refuses it; a request submitted otherwise ends with this)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_exception(BadRequest("this server has no grammar backend (--grammar-backend)"))
            return fut
        fut = self.grammars.start(spec)
        fut.add_done_callback(lambda _: self._wake.set())
        return fut

    @property
    def busy(self) -> bool:
        return any(s.running or s.waiting or s.kv_waiting for s in self.schedulers)

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> bool:
        """Take in the inbox, then one iteration of the step pipeline; False when every rank is idle and
        nothing is in flight."""
        self._drain_inbox()
        ran = self.pipeline.step()
        if self.rebalancer is not None:  # between two steps: count, decide, or move one chunk of layers
            self.rebalancer.after_step()
        return ran

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

    # ---- the background loop and streaming -----------------------------------------------------------
    def start(self, wakeups=None) -> None:
        """Start the loop in a thread of its own. `wakeups`: what the loop tells of the requests a step changed
        (default: this process's streams, `Wakeups`; the engine process's `Outbox` sends them to the server)."""
        if wakeups is not None:
            self.wakeups = wakeups
        if self._thread is None:
            self._stop = False
            self.nodes.start(self._start_thread)  # (several nodes: meets them first, then watches the waits)

    def _start_thread(self) -> None:
        self._thread = start_thread(self._loop, "jaxdp-engine")

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
                if self.failed is None and (message := self.nodes.step_failed(e)) is not None:
                    self.fail(message)  # a collective with a dead node fails here
                    return
                # a bug outside the step's own requests (a failed step is isolated in `step`): fail loudly
                log.exception("the engine loop failed; aborting all requests")
                self.pipeline.drop_inflight()  # its requests are aborted below; never booked again
                now = time.perf_counter()
                for s in self.schedulers:
                    for req in [*s.running.values(), *s.waiting]:
                        req.error = "internal error in the engine loop; see the server log"
                        s.finish(req, "abort", now)
                ran = False
            self.wakeups.deliver()
            if self.failed:
                return
            if not ran and self.nodes.waits_for_requests:
                # idle: wait for a request (other nodes wait inside the next exchange, for node 0)
                self._wake.wait(timeout=0.05)
                self._wake.clear()
        if not self.failed:
            self.nodes.stop()

    def fail(self, message: str, level: int = logging.ERROR) -> None:
        """Stop serving: every unfinished request ends with the message, new ones get it (HTTP 503)."""
        with self._fail_lock:  # the watchdog thread and the loop may both get here
            if self.failed:
                return
            self.failed = message
        log.log(level, "%s", message if level != logging.ERROR else f"{message}; this engine stops serving")
        now = time.perf_counter()
        for req in [*self.requests.values(), *self.nodes.requests_elsewhere(), *self._never_taken_in()]:
            if not req.finished:
                req.error_status = 503
                end_request(req, "abort", message, now)
                if self.disagg is not None:  # (a prefill server: its room is refused, the decode side stops waiting)
                    self.disagg.engine_failed(req, message)
        self.wakeups.deliver()
        self._stop = True
        self._wake.set()

    def _never_taken_in(self) -> list[Request]:
        """Failing: the requests still in the inbox (submitted while the loop waited on a node that stalled), which
        the loop, ending, will never take in."""
        out = []
        while True:
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if cmd == "add":
                out.append(arg)

    def rank_state(self, rank: int) -> dict:
        """The scheduler's figures of a rank of this engine (another node's: as of the last exchange)."""
        state = self.nodes.rank_state(rank)
        if state is None:
            return self.schedulers[rank].state()
        return state if self.disagg is None else self.disagg.remote_state(rank, state)

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

    def expert_record(self, action: str) -> RecordOutcome:
        """SGLang's expert-distribution recorder on this engine's steps: "start", "stop" or "dump" (the recording
        so far), done by the loop between two steps (`jaxdp.eplb.recorder.record`)."""
        fut = Result()
        self._post(("experts", (action, fut)))
        if self._thread is None:
            self._drain_inbox()
        outcome = fut.wait()
        if outcome is None:
            raise EngineFailed("the engine's loop did not take the recorder's request within 30 s")
        return outcome

    def record_experts(self, action: str) -> RecordOutcome:
        """Carry out a recorder action on this engine's runner now (the nodes' link calls it between two steps)."""
        return record(self.runner, action)

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
        if self.disagg is not None:
            self.disagg.close()
        self.runner.close()

