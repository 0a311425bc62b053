"""The step pipeline: one iteration of an engine's loop over the schedulers of its DP ranks and one StepRunner.

Each iteration (`step`): every rank's scheduler picks its batch (plan); the ranks agree (`agree_on_step`: rows
per rank, the decode-bucket vote, "any rank reads a prompt", through `Nodes.exchange`, which on one node is
the list itself); when a prompt is read anywhere, decoding ranks present their batch as one-token extends so
all ranks share one extend step (the relabeling); ranks without work run an idle (all-padding) batch while
any rank has work; nothing runs when all are idle. The compiled step is chosen from the busiest rank and
queued with its sampling on the device (queue); the tokens are read back and booked to the requests (book).

With `overlap`, step N+1 is planned and queued before step N's tokens are read back: rows whose input token is
still in flight carry a marker (-1-j: the j-th token step N sampled on this rank) that the step resolves on the
device, and step N is booked while N+1 runs. While a request with a grammar runs on this node the overlap is off:
its next token's bitmask is its matcher's after the last token, so step N is booked before N+1 is planned (the host
then waits for each step; unconstrained rows lose the overlap only while such requests run). A step that fails on
one node is retried in parts until the request that fails it is alone (`_isolate`); across nodes every node must
run every step, so the failure goes to the loop (`jaxdp.engine.loop`), which fails the engine.

The pipeline owns that order, the timing and the figures; what a step holds is a step kind's (`StepKind`), which
the pipeline is given: `PlainStep` here (prompt chunks and decodes, sampled on the device, with its prompt-logprob
part, `jaxdp.engine.step.prompt_logprobs.PromptLogprobs`) and, under speculative decoding, the verify step
(`jaxdp.engine.step.spec.VerifyStep`), chosen step by step by speculation's switch (`SpecSwitch`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any, Protocol

import numpy as np

from jaxdp.batch import SAMPLING_KEYS, STEP_FIELDS
from jaxdp.engine.nodes.hosts import first_line
from jaxdp.engine.nodes.link import Nodes
from jaxdp.engine.options import EngineConfig
from jaxdp.engine.sched.delayer import PrefillDelayer
from jaxdp.engine.sched.policy import SpecSwitch
from jaxdp.engine.sched.rank_plan import RankPlan, rank_proposals
from jaxdp.engine.sched.rows import RowArrays, plan_arrays
from jaxdp.engine.sched.scheduler import Scheduler
from jaxdp.engine.step.buckets import Buckets
from jaxdp.engine.step.controls import BIAS_OR_PENALTY, GRAMMAR, SamplingControls, plan_bitmask
from jaxdp.engine.step.prompt_logprobs import PromptLogprobs, chosen_ids
from jaxdp.engine.step.sampling import book_top_logprobs, sample_tokens, top_logprobs
from jaxdp.engine.step.step_stats import InFlight, Launched, StepStats, compiles_on_this_thread
from jaxdp.parallel.agreement import Agreement, Proposal, agree_on_step
from jaxdp.parallel.step import StepRunner, StepShape
from jaxdp.parallel.tbo_split import split_bits

log = logging.getLogger("jaxdp.engine")


class StepKind(Protocol):
    """One kind of step: the ranks' proposals for its agreement, its compiled shape, its arrays, queueing it on the
    device and booking its results to the schedulers."""

    overlaps: bool  # the next step may be queued before this one is booked

    def proposals(self, schedulers: list[Scheduler], plans: list[RankPlan | None]) -> list[Proposal]:
        ...

    def shape_for(self, rows: list[int], agreement: Agreement) -> StepShape:
        ...

    def arrays(self, plans: list[RankPlan | None], shape: StepShape, rows: list[int]) -> Any:
        """The step's host arrays (whatever `launch` takes)."""
        ...

    def launch(self, shape: StepShape, host: Any, plans: list[RankPlan | None], agreement: Agreement,
               prev_tokens: Any) -> Launched:
        """Queue the step (and its sampling) on the device; `prev_tokens`: the step in flight's, or None."""
        ...

    def book(self, schedulers: list[Scheduler], plans: list[RankPlan | None], out: Launched, now: float) -> int:
        """Book the step's results (`out`, read back) to the schedulers; returns the tokens booked."""
        ...


class PlainStep:
    """Prompt chunks and decodes over the persistent batch, sampled on the device (with the overlap, when on):
    top logprobs when a request asks, the every-row variant of an extend when a prompt asks for its logprobs
    (`prompt`, its part), and the sampling controls (logit bias, penalties, a grammar's bitmask) when a row has
    them (`controls`; None for a stand-in runner, which samples itself: the bitmask is still filled)."""

    def __init__(self, runner: StepRunner, buckets: Buckets, rows: RowArrays, overlap: bool,
                 prompt: PromptLogprobs, controls: SamplingControls | None = None):
        self.runner, self.buckets, self.rows, self.overlaps, self.prompt = runner, buckets, rows, overlap, prompt
        self.sample = getattr(runner, "sample_tokens", sample_tokens)  # a stand-in runner samples itself
        self.controls = controls
        self.vocab_size = runner.cfg.vocab_size
        self._grammar = False  # a plan of this node's ranks has a request with a grammar (its proposals said)

    def proposals(self, schedulers: list[Scheduler], plans: list[RankPlan | None]) -> list[Proposal]:
        tops = [s.top_logprob_requests > 0 for s in schedulers]  # ("a request asks for top logprobs": a count)
        controls = [s.controls(p) for s, p in zip(schedulers, plans, strict=True)]
        self._grammar = any(c & GRAMMAR for c in controls)
        out = rank_proposals(plans, self.buckets.decode[-1], self.rows.num_pages, tops, controls_R=controls)
        if self.buckets.tbo_threshold is not None:  # two-batch overlap: whether each rank's batch splits
            out = [dataclasses.replace(p, tbo=split_bits(plan_lens(plan), self.buckets.tbo_threshold)) if plan else p
                   for p, plan in zip(out, plans, strict=True)]
        return out

    def shape_for(self, rows: list[int], agreement: Agreement) -> StepShape:
        if agreement.any_prompt_logprobs:  # a prompt read in this step asks for logprobs: every row's logits
            return self.prompt.shape()
        return self.buckets.shape_for(rows, agreement, plain=True)

    def arrays(self, plans: list[RankPlan | None], shape: StepShape, rows: list[int]):
        runner = self.runner
        out = plan_arrays(plans, self.rows, shape, runner.page_size, runner.num_pages * runner.page_size)
        out["rows_R"] = np.asarray(rows, np.int32)
        params = [runner.put(out[k]) for k in SAMPLING_KEYS]
        asks = self.prompt.inputs(plans, out) if shape.all_logits else None  # (turns logits_idx_B into every row)
        return out, params, asks, plan_bitmask(plans, shape.num_seqs, self.vocab_size) if self._grammar else None

    def launch(self, shape: StepShape, host, plans: list[RankPlan | None], agreement: Agreement,
               prev_tokens) -> Launched:
        out, params, asks, bitmask = host
        runner = self.runner
        logits, _ = runner.run(shape, {k: out[k] for k in (*STEP_FIELDS, "rows_R")}, prev_tokens=prev_tokens)
        extra = {}
        if asks is not None:  # every row's logits: the sampler gets each sequence's row, the rest is reduced here
            logits, extra["prompt"] = self.prompt.reduce(runner, logits, asks)
        if self.controls is None:  # (a stand-in runner samples itself)
            tokens, logprobs = self.sample(logits, *params, width=runner.token_carry)
        else:
            if agreement.controls & BIAS_OR_PENALTY:
                self.controls.fill(plans)
            tokens, logprobs = self.controls.sample(logits, params, out, bitmask, agreement.controls,
                                                    runner.token_carry)
        if agreement.any_top:  # top logprobs: on every node together (the agreement says), or on none
            extra["top"] = top_logprobs(logits, runner.put(chosen_ids(plans, shape.num_seqs)))
        return Launched(tokens, logprobs, extra)

    def book(self, schedulers: list[Scheduler], plans: list[RankPlan | None], out: Launched, now: float) -> int:
        prompt, top = out.extra.get("prompt"), out.extra.get("top")
        for r, plan in enumerate(plans):
            if plan:
                if prompt is not None and plan.pieces:
                    self.prompt.book(plan, [a[r] for a in prompt])
                if top is not None:
                    book_top_logprobs(plan.reqs, plan.out_pos >= 0, *(a[r] for a in top))
                schedulers[r].book(plan, out.tokens[r], out.logprobs[r], now)
        return sum(p.num_sampled for p in plans if p)


class StepPipeline:
    """plan -> agree -> queue -> book, over `schedulers` (every DP rank's; this node plans its own) and `runner`,
    with the step kinds it is given: `plain`, and under speculative decoding `verify` with its `switch` (shared with
    the schedulers), which says after each step whether the next is a plain stretch's."""

    def __init__(self, runner: StepRunner, cfg: EngineConfig, schedulers: list[Scheduler], rows: RowArrays,
                 buckets: Buckets, nodes: Nodes, plain: PlainStep, verify: StepKind | None = None,
                 switch: SpecSwitch | None = None):
        self.runner, self.cfg, self.schedulers, self.rows, self.buckets, self.nodes = (
            runner, cfg, schedulers, rows, buckets, nodes)
        self.plain, self.verify, self.switch = plain, verify, switch
        self.sample = plain.sample
        self.kind: StepKind = plain if verify is None else verify  # this step's
        self.stats = StepStats(len(schedulers))
        self.delayer = PrefillDelayer(cfg.prefill_delayer, len(schedulers)) if cfg.prefill_delayer else None
        self.inflight: InFlight | None = None
        self.last_agreement = None
        self.blocked: tuple[float, str] | None = None  # (since, what): a wait on another node in progress
        self._steps = itertools.count()

    @property
    def prompt_logprob_steps(self) -> int:
        """Steps that returned every row's logits (a request asked for prompt logprobs)."""
        return self.plain.prompt.steps

    def step(self) -> bool:
        """One iteration; False when every rank is idle and nothing is in flight."""
        self.kind = self.plain if self.switch is None or self.switch.plain else self.verify
        if self.inflight is not None and (not self.kind.overlaps or any(s.constrained for s in self.schedulers)):
            # (a verify needs the last step's tokens; a grammar's bitmask needs its matcher past them)
            self._book(self.inflight, time.perf_counter())
            self.inflight = None
        busy = self._step()
        if self.switch is None:
            return busy
        self.switch.after(self.last_agreement)
        return busy or any(s.held_prompt for s in self.schedulers)  # (a request held back: the next pass reads it)

    def _step(self) -> bool:
        t0 = time.perf_counter()
        d = self.delayer  # prefill delayer: a new prompt waits while the last agreement says so
        plans: list[RankPlan | None] = [s.schedule(d is None or d.may_start_prompt(r), self.cfg.enable_mixed_chunk)
                                        for r, s in enumerate(self.schedulers)]
        ta = time.perf_counter()
        self.blocked = (ta, "exchanging the step's proposals")
        message = self.nodes.message()
        if d:  # the delayer's numbers ride on the exchange; every node decides the next pass from all of them
            d.post(message, [self.schedulers[r] for r in self.nodes.local_ranks])
        proposals, messages = self.nodes.exchange(self._proposals(plans), message)
        self.blocked = None
        self.nodes.receive(messages)
        if d:
            d.read(messages)
        agreement = self.last_agreement = agree_on_step(proposals)
        agree_s = time.perf_counter() - ta
        if not agreement.run:
            if self.inflight is None:
                return bool(d and d.pass_again)  # a prompt announced or held: the next pass decides, at once
            self._book(self.inflight, t0)
            self.inflight = None
            return True
        rows = list(agreement.rows_per_rank)  # every node's ranks (only this node's have plans here)
        shape = self.kind.shape_for(rows, agreement)
        compiles_before = compiles_on_this_thread()
        step = next(self._steps)
        try:
            current = self._queue(plans, shape, rows, agreement, t0, agree_s)
        except Exception:
            if not self.nodes.bisects_failures:  # a step across the nodes: every node must run it
                raise
            # not a user error (requests are validated, sampling clamps): find the request that fails it
            log.exception("engine step failed; retrying its requests in smaller steps to find the one that fails")
            if self.inflight is not None:
                self._book(self.inflight, time.perf_counter())
                self.inflight = None
            self._isolate(plans)
            return True
        for r, plan in enumerate(plans):
            if plan:
                self.schedulers[r].commit(plan, step)
        previous, self.inflight = self.inflight, current
        if previous is not None:
            self._book(previous, time.perf_counter())
        if current is not None and not self.kind.overlaps:
            self._book(current, time.perf_counter())
            self.inflight = None
        self.stats.compiles_in_steps += compiles_on_this_thread() - compiles_before
        return True

    def _queue(self, plans: list[RankPlan | None], shape: StepShape, rows: list[int], agreement,
               t0: float, agree_s: float) -> InFlight:
        """Build the step's arrays from the plans and queue it (and its sampling) on the device."""
        kind = self.kind
        host = kind.arrays(plans, shape, rows)
        t1 = time.perf_counter()
        prev = self.inflight.out.tokens if self.inflight is not None else None
        self.runner.compile(shape)  # (a no-op after warm-up) not counted as waiting for the other nodes
        self.blocked = (time.perf_counter(), "queueing a step that runs on every node")  # may wait for the last
        out = kind.launch(shape, host, plans, agreement, prev)
        self.blocked = None
        return InFlight(kind, plans, out, shape, rows, agreement, self.runner.last_account, host_s=t1 - t0,
                        dispatch_s=time.perf_counter() - t1, agree_s=agree_s)

    def _proposals(self, plans: list[RankPlan | None]) -> list[Proposal]:
        out = self.kind.proposals(self.schedulers, plans)
        return out if self.switch is None else self.switch.with_held(out, self.schedulers)

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
            only: list[RankPlan | None] = [None] * len(self.schedulers)
            only[r] = plan
            agreement = agree_on_step(self._proposals(only))
            rows = list(agreement.rows_per_rank)
            shape = self.kind.shape_for(rows, agreement)
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
        local = self.runner.local_values
        tokens, logprobs = local(f.out.tokens), local(f.out.logprobs)  # waits for the step to finish
        self.blocked = None
        t1 = time.perf_counter()
        out = Launched(tokens, logprobs, {k: [local(a) for a in v] for k, v in f.out.extra.items()})
        booked = f.kind.book(self.schedulers, f.plans, out, t1)
        t2 = time.perf_counter()
        self.stats.record(f.shape, f.rows, f.agreement, f.account, host_s=f.host_s + (t2 - t1),
                          dispatch_s=f.dispatch_s, wait_s=t1 - t0, agree_s=f.agree_s, compiled=0, new_tokens=booked)

    def drop_inflight(self) -> None:
        """Forget the step in flight (its requests are aborted): it is never booked."""
        self.inflight = None


def plan_lens(plan: RankPlan) -> list[int]:
    """A rank's sequences' rows in the step's order (`jaxdp.engine.sched.rows.plan_arrays`): its prompt pieces, then
    its decoders (one row each)."""
    return [len(p.tokens) for p in plan.pieces] + [1] * (plan.num_rows - sum(len(p.tokens) for p in plan.pieces))
