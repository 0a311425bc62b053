"""Speculative decoding (MTP / EAGLE, topk 1) in the engine: what a rank plans, how a step's arrays are laid out,
and how its tokens are booked. The step itself is `jaxdp.parallel.spec_step`.

Under speculation every step is a speculative one. A rank that reads a prompt plans its chunks as usual (the last
chunk also holds the pages its first drafts are written into); otherwise it verifies every running request: one
piece per request, its last token and its D drafts at the next D positions, with pages held up to 2D positions
ahead (the verify's rows, then the chained drafts after the longest acceptance). The ranks agree on rows as in
any step (a verify counts D + 1 rows a request), so a rank with nothing to do runs the idle step beside the
others. A verify runs without the overlap: the next verify needs this one's accepted tokens. Booking appends 1 to
D + 1 tokens a request, checking stops at each; the request's length, not its pages, says which latents count, so the
rejected rows' slots are written again by the next verify and only accepted tokens reach the prefix cache.

With --speculative-disable-by-batch-size N the pipeline runs plain stretches (plain steps, with the plain engine's
overlap) while more than N requests are held or none drafts; `jaxdp.engine.sched.policy.SpecSwitch` decides them.
No draft is made in a stretch, so a request's first verify after one offers none (one row, n_draft 0) and its MTP
pass drafts again; a request whose prompt a stretch read has no draft KV of it and never drafts (`speculates`).
The prefix cache does not know which pages' draft KV was written: a request that speculates and reuses a prefix
read in a stretch drafts from stale draft KV there (its tokens stay exact; only acceptance may drop).
"""

from __future__ import annotations

import logging

import numpy as np

from jaxdp.batch import Piece, empty_spec, empty_step, fill_pieces
from jaxdp.engine.sched.finish import finish_reason
from jaxdp.engine.sched.policy import SpecSwitch
from jaxdp.engine.sched.rank_plan import RankPlan, rank_proposals
from jaxdp.engine.sched.request import State
from jaxdp.engine.sched.rows import RowArrays, fill_sampling, sampling_row
from jaxdp.engine.sched.scheduler import Scheduler
from jaxdp.engine.step.buckets import Buckets
from jaxdp.engine.step.controls import BIAS_OR_PENALTY, GRAMMAR, SamplingControls
from jaxdp.engine.step.step_stats import Launched
from jaxdp.grammar.base import draft_bitmasks
from jaxdp.parallel.agreement import Agreement, Proposal
from jaxdp.parallel.spec_step import run_spec_step, spec_bitmask_shape
from jaxdp.parallel.step import StepShape

log = logging.getLogger("jaxdp.engine")


def check_speculative(cfg):
    """The engine config's speculative decoding, checked against what it cannot serve with (ValueError in one
    sentence naming the flag)."""
    spec = cfg.speculative
    if spec is None:
        return None
    if cfg.enable_mixed_chunk:
        raise ValueError("--enable-mixed-chunk cannot serve with --speculative-algorithm (a prompt step does not "
                         "verify); leave one of them out")
    if cfg.disaggregation is not None:
        raise ValueError("--disaggregation-mode cannot serve with --speculative-algorithm yet (the draft KV is not "
                         "handed over); leave one of them out")
    if spec.disable_by_batch_size is not None:
        log.info("speculative decoding: off while more than %d requests are held, running or waiting "
                 "(--speculative-disable-by-batch-size)", spec.disable_by_batch_size)
    log.info("speculative decoding: verify steps run without the overlap (each needs the last one's tokens)%s",
             "; plain stretches keep it" if cfg.overlap and spec.disable_by_batch_size is not None else "")
    return spec


class SpecScheduler(Scheduler):
    """A rank's scheduler under speculative decoding with `draft_tokens` drafts a request per step; `switch` (the
    pipeline's) says whether the step it plans belongs to a plain stretch (module docstring)."""

    def __init__(self, *args, draft_tokens: int, switch: SpecSwitch, **kwargs):
        super().__init__(*args, lookahead=draft_tokens, **kwargs)  # (a prompt's last chunk: its first drafts' slots)
        self.draft_tokens, self.switch = draft_tokens, switch
        self.held_prompt = False  # this rank's last plan held such a request back (the next pass reads it)
        self.verify_steps = 0  # verifies this rank ran (a request each), and what they accepted
        self.drafted = 0
        self.accepted = 0

    def state(self) -> dict:
        out = super().state()
        out["spec_accept_length"] = 1 + self.accepted / self.verify_steps if self.verify_steps else 0.0
        out["spec_accept_rate"] = self.accepted / self.drafted if self.drafted else 0.0
        return out

    @property
    def drafting(self) -> bool:
        """A request of this rank drafts or would: one that speculates, running or waiting to be read."""
        return any(r.speculates for r in self.running.values()) or any(r.speculates for r in self.waiting)

    def schedule(self, allow_new_prompt: bool = True, mixed_chunk: bool = False) -> RankPlan | None:
        self.held_prompt = self.switch.quiet and allow_new_prompt and any(r.speculates for r in self.waiting)
        if self.held_prompt:
            allow_new_prompt = False  # (its proposal says `drafting`: the next step reads it, speculatively)
        return super().schedule(allow_new_prompt, mixed_chunk)

    def _schedule_decode(self) -> RankPlan | None:
        """Verify every running request that may still grow, each holding pages 2D positions ahead (retracting
        the newest requests when the pool runs dry, as a decode does); in a plain stretch, the plain decode."""
        if self.switch.plain:
            return super()._schedule_decode()
        reach = 2 * self.draft_tokens
        for req in list(self.running.values()):
            if req.rid not in self.running:  # retracted below for an earlier one
                continue
            need = min(self.pool.pages_for(req.num_tokens - 1 + reach), self.rows.pages_per_seq) - len(req.pages)
            if need <= 0:
                continue
            while (pages := self._take_pages(need)) is None and self.running:
                self._retract(next(reversed(self.running.values())))
                if req.rid not in self.running:
                    break
            if req.rid in self.running and pages is not None:
                self.rows.add_pages(req, pages)
        reqs = [r for r in self.running.values() if len(r.output_ids) < self.limit(r)]
        if not reqs:
            return None
        pieces = [Piece([r.output_ids[-1], *r.drafts], r.num_tokens - 1, r.pages) for r in reqs]
        eos = self.eos_token_ids
        sampling = [sampling_row(r.params, r.rid, self.cfg.seed, self.cfg.vocab_size, eos, r.penalty_slot)
                    for r in reqs]
        return RankPlan("verify", reqs, pieces, sampling=sampling)

    def commit(self, plan: RankPlan, step: int) -> None:
        if plan.kind != "verify":
            if self.switch.plain:  # a plain stretch's step: no drafts are made, the next verify offers none
                for req in plan.reqs:
                    req.drafts = []
                    if plan.kind == "extend" and req.state == State.WAITING:  # its prompt: no draft KV of it
                        req.speculates = False
            return super().commit(plan, step)
        plan.step = step
        plan.out_pos = np.asarray([len(r.output_ids) for r in plan.reqs], np.int64)
        for req, piece in zip(plan.reqs, plan.pieces, strict=True):
            req.scheduled = piece.start + len(piece.tokens)

    def book_spec(self, plan: RankPlan, tokens_BJ: np.ndarray, counts_B: np.ndarray, logprobs_BJ: np.ndarray,
                  drafts_BD: np.ndarray, now: float) -> int:
        """One speculative step's results: each sampling request gets its accepted drafts and the next token
        (stopping at the first that ends it) and its next drafts. Returns the tokens booked."""
        verify = plan.kind == "verify"
        booked = 0
        for i, req in enumerate(plan.reqs):
            if req.finished:  # aborted meanwhile
                continue
            piece, n = plan.pieces[i], int(counts_B[i])
            if verify:
                req.computed = piece.start + n  # the last token and the accepted drafts
                if len(piece.tokens) > 1:  # (a verify after a stretch offers no drafts)
                    req.spec_verify_ct += 1
                    req.spec_accepted += n - 1
                    self.verify_steps += 1
                    self.drafted += len(piece.tokens) - 1
                    self.accepted += n - 1
            else:
                req.computed = max(req.computed, piece.start + len(piece.tokens))
                if plan.out_pos[i] < 0:  # a prompt chunk that samples nothing
                    continue
                del req.output_ids[plan.out_pos[i]:]  # its marker
            req.drafts = [t for t in drafts_BD[i].tolist() if t >= 0] if req.speculates else []
            reason = self._append(req, tokens_BJ[i, :n].tolist(), logprobs_BJ[i, :n].tolist(), now)
            booked += n
            a = self.rows.a
            a.n_out[req.row], a.length[req.row], a.token[req.row], a.step[req.row] = (
                len(req.output_ids), req.num_tokens, req.output_ids[-1], -1)
            if reason is not None:
                self.finish(req, reason, now)
            elif req.on_update:
                req.on_update(req)
        return booked

    def _append(self, req, tokens: list[int], logprobs: list[float], now: float) -> str | None:
        """Append a request's new tokens one by one; the reason it finishes at one of them, or None."""
        p = req.params
        for tok, lp in zip(tokens, logprobs, strict=True):
            req.output_ids.append(tok)
            if p.return_logprob:
                req.output_logprobs.append(lp)
            if req.first_token_at is None:
                req.first_token_at = now
            if req.matcher is not None and not req.matcher.accept(tok):  # (the masks allow only what it accepts)
                req.error = f"token {tok} does not follow the request's grammar; the request ends there"
                return "abort"
            if (reason := finish_reason(req, tok, len(req.output_ids), self.limit(req), self.eos_token_ids)):
                return reason
        return None


def spec_arrays(plans: list[RankPlan | None], shape, page_size: int, pad_slot: int) -> dict[str, np.ndarray]:
    """A speculative step's arrays from every rank's plan: the rows as in an extend (each request a piece) or, in
    the absorbed form, as in a decode (each verify row a sequence of its own at its position); per request
    (`jaxdp.batch.SPEC_SPEC`) its rows and drafts, the token after a chunk that does not end its prompt, and the
    slots of the 2D - 1 positions after the earliest row a verify may stop at (where the chained drafts write)."""
    D, dp = shape.draft_tokens, len(plans)
    out = empty_step(dp, shape.num_rows, shape.num_seqs, shape.pages_per_seq, pad_slot)
    out |= empty_spec(dp, shape.num_rows, shape.num_requests, D, pad_slot)
    ahead = np.arange(1, 2 * D)
    for r, plan in enumerate(plans):
        if plan is None:
            continue
        if shape.absorbed:  # every row a sequence: its request's pages, its own length
            fill_pieces(out, r, [Piece([t], p.start + j, p.pages) for p in plan.pieces for j, t in enumerate(p.tokens)],
                        page_size)
        else:
            fill_pieces(out, r, plan.pieces, page_size)
        verify, row = plan.kind == "verify", 0
        for b, (req, piece) in enumerate(zip(plan.reqs, plan.pieces, strict=True)):
            m, end = len(piece.tokens), piece.start + len(piece.tokens)
            n_draft = m - 1 if verify else 0  # (D, or 0 after a stretch)
            out["first_row_R"][r, b], out["last_row_R"][r, b], out["n_draft_R"][r, b] = row, row + m - 1, n_draft
            out["req_T"][r, row: row + m] = b
            if verify:
                out["drafts_RD"][r, b, :n_draft] = piece.tokens[1:]
            samples = verify or end == req.num_tokens
            out["live_R"][r, b] = samples
            out["next_token_R"][r, b] = -1 if samples else req.all_ids[end]
            pos = piece.start + m - 1 - n_draft + ahead
            pages = np.asarray(piece.pages, np.int64)
            held = pos < len(pages) * page_size
            slots = pages[np.minimum(pos // page_size, len(pages) - 1)] * page_size + pos % page_size
            out["ahead_slots_RA"][r, b] = np.where(held & samples, slots, pad_slot)
            fill_sampling(out, r, b, *plan.sampling[b], len(req.output_ids))
            if not samples:  # (a chunk that samples nothing counts nothing)
                out["pen_slot"][r, b] = -1
            row += m
    return out


class VerifyStep:
    """The speculative step as a step kind of the pipeline (`jaxdp.engine.step.pipeline.StepKind`): prompt chunks
    and verifies laid out by `spec_arrays`, run by `jaxdp.parallel.spec_step`, booked by `SpecScheduler.book_spec`;
    never overlapped (the next verify needs this one's accepted tokens). Its sampling controls (logit bias,
    penalties, min_tokens) apply inside the step, each verify position seeing what plain decoding would
    (`jaxdp.engine.step.controls.prepare_verify`), over the penalty state it shares with the plain steps
    (`controls`, whose slots are filled here before the step that first samples a request). A request with a
    grammar gets a bitmask at each of its D + 1 positions (`verify_bitmask`), applied in the step too; its matcher
    moves on by the tokens booked."""

    overlaps = False

    def __init__(self, runner, buckets: Buckets, rows: RowArrays, controls: SamplingControls | None = None):
        self.runner, self.buckets, self.rows, self.controls = runner, buckets, rows, controls
        self._grammar = False  # a plan of this node's ranks has a request with a grammar (its proposals said)
        self._stops: frozenset[int] = frozenset()

    def proposals(self, schedulers: list[Scheduler], plans: list[RankPlan | None]) -> list[Proposal]:
        controls = [s.controls(p) for s, p in zip(schedulers, plans, strict=True)]
        self._grammar = any(c & GRAMMAR for c in controls)
        self._stops = schedulers[0].eos_token_ids if schedulers else frozenset()
        return rank_proposals(plans, self.buckets.largest_decode_rows, self.rows.num_pages,
                              largest_decode_requests=self.buckets.decode[-1], controls_R=controls)

    def shape_for(self, rows: list[int], agreement: Agreement) -> StepShape:
        return self.buckets.shape_for(rows, agreement)

    def arrays(self, plans: list[RankPlan | None], shape: StepShape, rows: list[int]) -> dict[str, np.ndarray]:
        runner = self.runner
        out = spec_arrays(plans, shape, runner.page_size, runner.num_pages * runner.page_size)
        out["rows_R"] = np.asarray(rows, np.int32)
        out["seqs_R"] = np.asarray([len(p.reqs) if p else 0 for p in plans], np.int32)  # (the chain's gather)
        if self._grammar:
            out["bitmask"] = verify_bitmask(plans, spec_bitmask_shape(runner, shape), self._stops)
        return out

    def launch(self, shape: StepShape, host: dict[str, np.ndarray], plans: list[RankPlan | None],
               agreement: Agreement, prev_tokens) -> Launched:
        bits = agreement.controls if self.controls is not None else 0
        if bits & BIAS_OR_PENALTY:
            self.controls.fill(plans)
        tokens, counts, logprobs, drafts, _ = run_spec_step(self.runner, shape, host, self.controls, bits,
                                                            host.get("bitmask"))
        return Launched(tokens, logprobs, {"spec": (counts, drafts)})

    def book(self, schedulers: list[Scheduler], plans: list[RankPlan | None], out: Launched, now: float) -> int:
        counts, drafts = out.extra["spec"]
        return sum(schedulers[r].book_spec(plan, out.tokens[r], counts[r], out.logprobs[r], drafts[r], now)
                   for r, plan in enumerate(plans) if plan)


def verify_bitmask(plans: list[RankPlan | None], shape: tuple[int, ...], stops) -> np.ndarray | None:
    """A speculative step's grammar bitmasks [dp, R, D + 1, W]: a constrained request that samples gets, at verify
    position j, what its grammar allows after its drafts 0..j-1 (`jaxdp.grammar.base.draft_bitmasks`: its matcher
    walked through them and rolled back); a prompt chunk's first token, its matcher's mask now at every position;
    every other row allows everything. None when no request of the plans has a grammar."""
    rows = [(r, b, plan, req) for r, plan in enumerate(plans) if plan for b, req in enumerate(plan.reqs)
            if req.matcher is not None]
    if not rows:
        return None
    mask = np.full(shape, -1, np.int32)
    for r, b, plan, req in rows:
        piece = plan.pieces[b]
        if plan.kind == "verify":
            draft_bitmasks(req.matcher, list(piece.tokens[1:]), tuple(stops), mask[r, b])
        elif piece.start + len(piece.tokens) == req.num_tokens:  # a prompt's last chunk: its first token
            req.matcher.fill(mask[r, b, 0])
            mask[r, b, 1:] = mask[r, b, 0]
    return mask
