"""Logprobs beyond the sampled token: the prompt's own (SGLang's input_token_logprobs, vLLM's prompt_logprobs,
OpenAI's echo) and, per output token, chosen token ids (token_ids_logprob).

A step in which some request asks for prompt logprobs runs the extend step's variant that returns the logits of
every row (`Buckets.prompt_logprob_shape`, compiled at start-up; every other step is unchanged): the row of
prompt position p gives the logprob of token p + 1, the next token of the prompt, which the host knows, so a
prompt read in several chunks gets its logprobs chunk by chunk (the last row of a chunk predicts the first token
of the next). `prompt_logprobs` reduces those logits on the device to what the host reads back (one value per
row, the top alternatives, the chosen ids), and hands the sampler one row per sequence as usual. The first
prompt token has no logprob (nothing predicts it): None, as in SGLang and vLLM. `PromptLogprobs` is that part of
the plain step (`jaxdp.engine.step.pipeline.PlainStep`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.engine.sched.rank_plan import RankPlan
from jaxdp.engine.sched.request import MAX_LOGPROB_TOKEN_IDS, Request
from jaxdp.engine.step.buckets import Buckets
from jaxdp.engine.step.sampling import top_logprobs
from jaxdp.parallel.step import StepShape


@jax.jit
def prompt_logprobs(logits_RTV, seq_rows_RB, targets_RT, ids_RTM):
    """From the logits of every row [dp, T, V]: each sequence's sampling row [dp, B, V], the logprob of each
    row's target token [dp, T], the MAX_TOP_LOGPROBS best (ids, logprobs) [dp, T, K] and the logprobs of the
    chosen ids [dp, T, M], under the unmodified distribution."""
    seq_RBV = jnp.take_along_axis(logits_RTV, seq_rows_RB[..., None], axis=1)
    # the target is one more id each row asks about, beside its chosen ids: one log-softmax for all
    ids, values, asked_RTM = top_logprobs(logits_RTV, jnp.concatenate([targets_RT[..., None], ids_RTM], axis=2))
    return seq_RBV, asked_RTM[..., 0], ids, values, asked_RTM[..., 1:]


def chosen_ids(plans: list[RankPlan | None], num_seqs: int) -> np.ndarray:
    """Each sequence's token_ids_logprob, padded [dp, B, MAX_LOGPROB_TOKEN_IDS] (a plan's reqs are its sequences)."""
    out = np.zeros((len(plans), num_seqs, MAX_LOGPROB_TOKEN_IDS), np.int32)
    for r, plan in enumerate(plans):
        for b, req in enumerate(plan.reqs if plan else ()):
            ids = req.params.token_ids_logprob
            if ids:
                out[r, b, : len(ids)] = ids
    return out


def prompt_inputs(plans: list[RankPlan | None], out: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
    """Turn a step's arrays into those of the every-row variant (logits_idx_B: every row) and return what
    `prompt_logprobs` reads: each sequence's sampling row [dp, B], each row's target [dp, T] (the prompt's next
    token where its request asks) and the chosen ids [dp, T, M]."""
    dp, T = out["tokens_T"].shape
    seq_rows = out["logits_idx_B"].copy()
    out["logits_idx_B"] = np.broadcast_to(np.arange(T, dtype=np.int32), (dp, T)).copy()
    targets = np.zeros((dp, T), np.int32)
    ids = np.zeros((dp, T, MAX_LOGPROB_TOKEN_IDS), np.int32)
    for r, plan in enumerate(plans):
        row = 0
        for req, piece in zip(plan.reqs if plan else (), plan.pieces if plan else (), strict=False):
            n = len(piece.tokens)
            if req.prompt_logprobs_left:
                prompt = req.prompt_ids
                nxt = np.arange(piece.start + 1, min(piece.start + n + 1, len(prompt)))
                targets[r, row: row + len(nxt)] = np.asarray(prompt, np.int32)[nxt]
                chosen = req.params.token_ids_logprob
                if chosen:
                    ids[r, row: row + n, : len(chosen)] = chosen
            row += n
    return seq_rows, targets, ids


def book_prompt_logprobs(plan: RankPlan, target_T: np.ndarray, top_ids_TK: np.ndarray, top_values_TK: np.ndarray,
                         ids_TM: np.ndarray) -> None:
    """Give each request of the plan's prompt pieces that asks the logprobs of its prompt positions this step
    computed, in order, each position once (a request read again after a retraction has them all already)."""
    row = 0
    for req, piece in zip(plan.reqs, plan.pieces, strict=False):
        n = len(piece.tokens)
        if req.prompt_logprobs_left and not req.finished:
            _book_rows(req, piece.start, row, n, target_T, top_ids_TK, top_values_TK, ids_TM)
        row += n


def _book_rows(req: Request, start: int, row: int, n: int, target_T, top_ids_TK, top_values_TK, ids_TM) -> None:
    p = req.params
    first, length, k, chosen = p.logprob_start_len, len(req.prompt_ids), p.top_logprobs, p.token_ids_logprob
    if first == 0 and not req.input_logprobs:  # the first prompt token: nothing predicts it
        req.input_logprobs.append(None)
        if k:
            req.input_top_logprobs.append(None)
        if chosen:
            req.input_token_ids_logprobs.append(None)
    for i in range(n):
        q = start + i + 1  # the position row `row + i` predicts
        if q >= length:
            break
        if q != first + len(req.input_logprobs):
            continue
        req.input_logprobs.append(float(target_T[row + i]))
        if k:
            req.input_top_logprobs.append(list(zip(top_ids_TK[row + i, :k].tolist(),
                                                   top_values_TK[row + i, :k].tolist(), strict=True)))
        if chosen:
            req.input_token_ids_logprobs.append(list(zip(chosen, ids_TM[row + i, : len(chosen)].tolist(),
                                                         strict=True)))


class PromptLogprobs:
    """The plain step's part for prompt logprobs: its every-row shape, its inputs, the reduction on the device and the
    booking; `steps` counts the steps that returned every row's logits."""

    def __init__(self, buckets: Buckets):
        self.buckets = buckets
        self.steps = 0

    def shape(self) -> StepShape:
        """The every-row variant of an extend (a step in which some prompt asks for its logprobs)."""
        self.steps += 1
        return self.buckets.prompt_logprob_shape()

    def inputs(self, plans: list[RankPlan | None], out: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        return prompt_inputs(plans, out)

    def reduce(self, runner, logits_RTV, asks: tuple[np.ndarray, ...]):
        """Every row's logits -> (each sequence's sampling row, the prompt's logprobs on the device)."""
        seq_RBV, *prompt = prompt_logprobs(logits_RTV, *(runner.put(a) for a in asks))
        return seq_RBV, tuple(prompt)

    def book(self, plan: RankPlan, prompt: list[np.ndarray]) -> None:
        """A rank's plan gets its prompt logprobs (`prompt`: that rank's arrays, read back)."""
        book_prompt_logprobs(plan, *prompt)
