"""Sampling controls on the device, between the model's logits and the sampler: a logit bias, penalties over the
tokens a request has seen, and a grammar's token bitmask.

`prepare` turns a step's logits [dp, B, V] into the logits its rows choose from; the sampler
(`jaxdp.engine.step.sampling.sample_tokens`) draws from those and reports each token's log-probability under the
unmodified logits (vLLM's default `logprobs_mode`, "raw_logprobs"; SGLang reports the unmodified ones too). In
vLLM's order: the logit bias (OpenAI's `logit_bias`, added), then the penalties, then (in the sampler) min_tokens'
ban, the temperature and the filters. The penalties: `repetition_penalty` (HF's and vLLM's rule, over the prompt
and the output: a positive logit of a token seen is divided by it, a negative one multiplied), then OpenAI's
`frequency_penalty` * count + `presence_penalty` * (count > 0) subtracted, over the output tokens only. A grammar's
bitmask (bit j of word i: token 32 i + j allowed) sets every other token to -inf.

Penalties need what each request has seen: a per-rank pool of penalty slots on the device, output-token counts
[dp, P, V] int32 and prompt presence [dp, P, V] bool. The scheduler books slot numbers (host ints: a request
takes one when admitted, gives it back when it leaves or is retracted); here a slot is filled from the request's
prompt and any output it already has (`fill_slots`, before the step that first samples it), and each sampled
token is counted on the device right after sampling (`counted`, the state donated), so there is no host round
trip per token and, with the overlap, the next step (queued after this one) sees this one's tokens. A slot freed
while a step is in flight may still be counted into by that step: whoever takes it next is filled after it, in
queue order. Across nodes each node fills its own ranks' slots (`fill_slots` has no collective: each rank's slot
is its own devices' rows), while the agreement's bits make every node run the same `prepare` and `counted`.

Steps whose rows have no controls (the agreement's bits, `Agreement.controls`, say none on any rank) run none of
this; a step with some runs `prepare` (each part a `lax.cond`, so rows and steps without it pay little) and, with
penalties, `counted`. Every variant is compiled at start-up (`warm`); none while serving.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.batch import CONTROL_KEYS
from jaxdp.engine.sched.rank_plan import RankPlan

BIAS_OR_PENALTY, GRAMMAR = 1, 2  # the bits of `Agreement.controls`
FILL_CHUNK = 2048  # token ids a slot is filled with per call (a long prompt takes several)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allowed_tokens(bitmask_RBW, vocab_size: int):
    """The bitmask as booleans [dp, B, V]."""
    bits = (bitmask_RBW[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(*bitmask_RBW.shape[:-1], -1)[..., :vocab_size].astype(bool)


@jax.jit
def prepare(logits_RBV, bias_ids_RBX, bias_values_RBX, pen_slot_RB, frequency_RB, presence_RB, repetition_RB,
            counts_RPV, seen_RPV, bitmask_RBW):
    """The logits a step's rows choose from: the logit bias added, the penalties applied, and every token the
    bitmask does not allow at -inf (module docstring). One variant per batch size: a step without a grammar passes
    an all-ones bitmask kept on the device."""
    V = logits_RBV.shape[-1]
    out = logits_RBV.astype(jnp.float32)

    def bias():
        ids = jnp.where(bias_ids_RBX >= 0, bias_ids_RBX, V)  # (V: dropped)
        return jax.vmap(jax.vmap(lambda lv, i, b: lv.at[i].add(b, mode="drop")))(out, ids, bias_values_RBX)

    out = jax.lax.cond(jnp.any(bias_ids_RBX >= 0), bias, lambda: out)
    has = pen_slot_RB >= 0

    def penalise():
        at = jnp.where(has, pen_slot_RB, 0)
        counts = jax.vmap(lambda c, s: c[s])(counts_RPV, at)  # [dp, B, V]
        seen = jax.vmap(lambda p, s: p[s])(seen_RPV, at)
        rep = jnp.where(has, repetition_RB, 1.0)[..., None]
        hit = seen | (counts > 0)
        x = jnp.where(hit, jnp.where(out > 0, out / rep, out * rep), out)
        sub = frequency_RB[..., None] * counts + presence_RB[..., None] * (counts > 0)
        return x - jnp.where(has[..., None], sub, 0.0)

    out = jax.lax.cond(jnp.any(has), penalise, lambda: out)
    out = jnp.where(allowed_tokens(bitmask_RBW, V), out, -jnp.inf)
    return out.astype(logits_RBV.dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def counted(counts_RPV, pen_slot_RW, tokens_RW):
    """The counts with each penalised row's sampled token added (both padded to the carry width W, so one variant
    serves every batch size)."""
    P = counts_RPV.shape[1]

    def add():
        slot = jnp.where(pen_slot_RW >= 0, pen_slot_RW, P)  # (P: dropped)
        return jax.vmap(lambda c, s, t: c.at[s, t].add(1, mode="drop"))(counts_RPV, slot, tokens_RW)

    return jax.lax.cond(jnp.any(pen_slot_RW >= 0), add, lambda: counts_RPV)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def fill_slots(counts_RPV, seen_RPV, slot_R, reset_R, ids_RC, output_RC):
    """Each rank's slot `slot_R` (-1: none) cleared first when `reset_R`, then given ids_RC (-1 padded): an output
    token counts, a prompt token is marked seen."""
    P, V = counts_RPV.shape[1:]

    def one(c, s, slot, reset, ids, out):
        at = jnp.where(slot >= 0, slot, 0)
        crow = jnp.where(reset, 0, c[at]).at[jnp.where(out & (ids >= 0), ids, V)].add(1, mode="drop")
        srow = jnp.where(reset, False, s[at]).at[jnp.where(~out & (ids >= 0), ids, V)].set(True, mode="drop")
        dst = jnp.where(slot >= 0, slot, P)
        return c.at[dst].set(crow, mode="drop"), s.at[dst].set(srow, mode="drop")

    return jax.vmap(one)(counts_RPV, seen_RPV, slot_R, reset_R, ids_RC, output_RC)


def plan_bitmask(plans: list[RankPlan | None], num_seqs: int, vocab_size: int) -> np.ndarray | None:
    """The step's bitmask [dp, B, ceil(V/32)]: each constrained request's matcher fills its row (sequence j of a
    rank's step is its plan's request j), every other row allows everything; None when no request has a grammar."""
    rows = [(r, j, req) for r, plan in enumerate(plans) if plan for j, req in enumerate(plan.reqs)
            if req.matcher is not None]
    if not rows:
        return None
    mask = np.full((len(plans), num_seqs, bitmask_words(vocab_size)), -1, np.int32)
    for r, j, req in rows:
        req.matcher.fill(mask[r, j])
    return mask


class SamplingControls:
    """A runner's penalty state (`slots` per rank over a vocabulary of `vocab_size`) and the controlled sampling of
    a step (module docstring)."""

    def __init__(self, runner, dp: int, slots: int, vocab_size: int):
        self.runner, self.dp, self.vocab_size = runner, dp, vocab_size
        self.slots = max(slots, 1)
        self.counts = runner.put(np.zeros((dp, self.slots, vocab_size), np.int32))
        self.seen = runner.put(np.zeros((dp, self.slots, vocab_size), np.bool_))
        self._allow_all: dict[int, jax.Array] = {}  # by batch size: the bitmask of a step without a grammar

    def fill(self, plans: list[RankPlan | None]) -> None:
        """Fill the slots this step's plans gave (their requests' prompt and output so far), before it samples."""
        jobs: list[list[tuple[int, bool, list[int], bool]]] = [[] for _ in range(self.dp)]
        for r, plan in enumerate(plans):
            for req in plan.inits if plan else ():
                done = [t for t in req.output_ids if t >= 0]
                parts = [(req.prompt_ids, False), (done, True)]
                chunks = [(ids[i: i + FILL_CHUNK], out) for ids, out in parts for i in range(0, len(ids), FILL_CHUNK)]
                for k, (ids, out) in enumerate(chunks or [([], False)]):
                    jobs[r].append((req.penalty_slot, k == 0, ids, out))
        for k in range(max(map(len, jobs))):
            slot, reset = np.full(self.dp, -1, np.int32), np.zeros(self.dp, np.bool_)
            ids, out = np.full((self.dp, FILL_CHUNK), -1, np.int32), np.zeros((self.dp, FILL_CHUNK), np.bool_)
            for r, job in enumerate(jobs):
                if k < len(job):
                    slot[r], reset[r], chunk, out[r] = job[k]
                    ids[r, : len(chunk)] = chunk
            put = self.runner.put
            self.counts, self.seen = fill_slots(self.counts, self.seen, put(slot), put(reset), put(ids), put(out))

    def choose(self, logits, host: dict[str, np.ndarray], bitmask: np.ndarray | None):
        """The logits the step's rows choose from (then `count` its tokens)."""
        put, B = self.runner.put, logits.shape[1]
        if bitmask is None:  # (no grammar here, or only another node's)
            if B not in self._allow_all:
                self._allow_all[B] = put(np.full((self.dp, B, bitmask_words(self.vocab_size)), -1, np.int32))
            mask = self._allow_all[B]
        else:
            mask = put(bitmask)
        return prepare(logits, *(put(host[k]) for k in CONTROL_KEYS), self.counts, self.seen, mask)

    def count(self, pen_slot_RB: np.ndarray, tokens) -> None:
        """Count the step's sampled tokens (`tokens` [dp, W] on the device) into its penalised rows' slots."""
        slot = np.full(tokens.shape, -1, np.int32)
        slot[:, : pen_slot_RB.shape[1]] = pen_slot_RB
        self.counts = counted(self.counts, self.runner.put(slot), tokens)

    def warm(self, num_seqs: list[int], width: int, idle: dict[str, np.ndarray]) -> None:
        """Compile and run every variant once on padding (`idle`: a step's padding arrays of each B, by B)."""
        put = self.runner.put
        z = np.zeros(self.dp, np.int32)
        self.counts, self.seen = fill_slots(self.counts, self.seen, put(z - 1), put(z.astype(bool)),
                                            put(np.full((self.dp, FILL_CHUNK), -1, np.int32)),
                                            put(np.zeros((self.dp, FILL_CHUNK), np.bool_)))
        for B in num_seqs:
            self.choose(put(np.zeros((self.dp, B, self.vocab_size), np.float32)), idle[B], None)
        self.count(np.full((self.dp, 1), -1, np.int32), put(np.zeros((self.dp, width), np.int32)))
        jax.block_until_ready(self.counts)
