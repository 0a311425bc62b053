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

All of it runs inside one compiled sampling function per batch size, `sample_with_controls` (the logits prepared,
sampled, the tokens counted), each part under a `lax.cond` on whether any row of the step has it: a step whose
rows have none (the agreement's bits, `Agreement.controls`, say none on any rank) uploads nothing for them (it
passes padding arrays kept on the device) and pays three scalar tests. It is compiled at start-up with the steps
(`warm`), so the controls add no compile of their own but `fill_slots`'s; none while serving.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.batch import CONTROL_KEYS, empty_step
from jaxdp.engine.sched.rank_plan import RankPlan
from jaxdp.engine.step.sampling import sample_tokens

BIAS_OR_PENALTY, GRAMMAR = 1, 2  # the bits of `Agreement.controls`
FILL_CHUNK = 2048  # token ids a slot is filled with per call (a long prompt takes several)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def allowed_tokens(bitmask_RBW, vocab_size: int):
    """The bitmask as booleans [dp, B, V]."""
    bits = (bitmask_RBW[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(*bitmask_RBW.shape[:-1], -1)[..., :vocab_size].astype(bool)


def prepare(logits_RBV, bias_ids_RBX, bias_values_RBX, pen_slot_RB, frequency_RB, presence_RB, repetition_RB,
            counts_RPV, seen_RPV, bitmask_RBW):
    """The logits a step's rows choose from: the logit bias added, the penalties applied, and every token the
    bitmask does not allow at -inf (module docstring; a step without a grammar passes an all-ones bitmask)."""
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
        return penalised(out, counts, seen, has, frequency_RB, presence_RB, repetition_RB)

    out = jax.lax.cond(jnp.any(has), penalise, lambda: out)
    masked = lambda: jnp.where(allowed_tokens(bitmask_RBW, V), out, -jnp.inf)  # noqa: E731
    out = jax.lax.cond(jnp.any(bitmask_RBW != -1), masked, lambda: out)
    return out.astype(logits_RBV.dtype)


def penalised(logits_XV, counts_XV, seen_XV, has_X, frequency_X, presence_X, repetition_X):
    """The penalties applied to logits [..., V] (X: any leading axes) from the counts of the output tokens and the
    prompt's presence of each token; rows without penalties (`has_X` false) unchanged."""
    rep = jnp.where(has_X, repetition_X, 1.0)[..., None]
    hit = seen_XV | (counts_XV > 0)
    x = jnp.where(hit, jnp.where(logits_XV > 0, logits_XV / rep, logits_XV * rep), logits_XV)
    sub = frequency_X[..., None] * counts_XV + presence_X[..., None] * (counts_XV > 0)
    return x - jnp.where(has_X[..., None], sub, 0.0)


def counted(counts_RPV, pen_slot_RB, tokens_RB):
    """The counts with each penalised row's sampled token added."""
    P = counts_RPV.shape[1]

    def add():
        slot = jnp.where(pen_slot_RB >= 0, pen_slot_RB, P)  # (P: dropped)
        return jax.vmap(lambda c, s, t: c.at[s, t].add(1, mode="drop"))(counts_RPV, slot, tokens_RB)

    return jax.lax.cond(jnp.any(pen_slot_RB >= 0), add, lambda: counts_RPV)


def prepare_verify(logits_BJV, drafts_BD, n_draft_B, n_out_B, min_tokens_B, ban_BS, bias_ids_BX, bias_values_BX,
                   pen_slot_B, frequency_B, presence_B, repetition_B, counts_PV, seen_PV):
    """The logits a verify chooses from, on one rank (inside the speculative step): B requests, J = D + 1 positions
    each (position j: after the request's last token and its drafts 0..j-1, of which `n_draft_B` are offered).
    Position j gets what plain decoding would choose from had those drafts been accepted: the logit bias; the
    penalties over the slot's counts plus drafts 0..j-1 (output tokens; the prompt's presence as it is); then
    min_tokens' ban while n_out + j < min_tokens (`n_out_B`: tokens generated before position 0's)."""
    B, J, V = logits_BJV.shape
    out = logits_BJV.astype(jnp.float32)

    def bias():
        ids = jnp.where(bias_ids_BX >= 0, bias_ids_BX, V)  # (V: dropped)
        return jax.vmap(lambda lv, i, b: lv.at[:, i].add(b, mode="drop"))(out, ids, bias_values_BX)

    out = jax.lax.cond(jnp.any(bias_ids_BX >= 0), bias, lambda: out)
    has = pen_slot_B >= 0

    def penalise():
        at = jnp.where(has, pen_slot_B, 0)
        offered = jnp.arange(J - 1) < n_draft_B[:, None]
        # draft i counts at every later position j > i: one scatter into the slot's counts broadcast over the
        # positions (no [B, D, V] one-hot or running sum beside the [B, J, V] logits)
        later = jnp.arange(J)[None, :] > jnp.arange(J - 1)[:, None]  # [D, J]
        token = jnp.where(later[None] & offered[..., None], drafts_BD[..., None], V)  # [B, D, J] (V: dropped)
        position = jnp.broadcast_to(jnp.arange(J), token.shape)
        counts = jnp.broadcast_to(counts_PV[at][:, None], (B, J, V)).at[
            jnp.arange(B)[:, None, None], position, token].add(1, mode="drop")  # [B, J, V]
        seen = jnp.broadcast_to(seen_PV[at][:, None], counts.shape)
        per = lambda x: jnp.broadcast_to(x[:, None], (B, J))  # noqa: E731
        return penalised(out, counts, seen, per(has), per(frequency_B), per(presence_B), per(repetition_B))

    out = jax.lax.cond(jnp.any(has), penalise, lambda: out).astype(logits_BJV.dtype)
    below_BJ = n_out_B[:, None] + jnp.arange(J) < min_tokens_B[:, None]

    def ban():
        ids = jnp.where(below_BJ[..., None] & (ban_BS[:, None] >= 0), ban_BS[:, None], V)  # [B, J, S] (V: dropped)
        return jax.vmap(jax.vmap(lambda lv, i: lv.at[i].set(-jnp.inf, mode="drop")))(out, ids)

    return jax.lax.cond(jnp.any(below_BJ), ban, lambda: out)


def counted_verify(counts_PV, pen_slot_B, live_B, tokens_BJ):
    """One rank's counts with each penalised live request's tokens of a verify added (its accepted drafts and the
    token after them; -1: none)."""
    P, V = counts_PV.shape

    def add():
        slot = jnp.where((pen_slot_B >= 0) & live_B, pen_slot_B, P)  # (P: dropped)
        return counts_PV.at[slot[:, None], jnp.where(tokens_BJ >= 0, tokens_BJ, V)].add(1, mode="drop")

    return jax.lax.cond(jnp.any(pen_slot_B >= 0), add, lambda: counts_PV)


@functools.partial(jax.jit, static_argnames="width", donate_argnames="counts_RPV")
def sample_with_controls(logits_RBV, temperature_RB, top_p_RB, top_k_RB, min_p_RB, keys_RB2, min_tokens_RB, ban_RBS,
                         bias_ids_RBX, bias_values_RBX, pen_slot_RB, frequency_RB, presence_RB, repetition_RB,
                         counts_RPV, seen_RPV, bitmask_RBW, width: int):
    """A step's tokens and their unmodified log-probabilities (`sample_tokens`, padded to `width`), chosen from the
    prepared logits (`prepare`), and the counts with them added (`counted`; the counts donated)."""
    choose = prepare(logits_RBV, bias_ids_RBX, bias_values_RBX, pen_slot_RB, frequency_RB, presence_RB,
                     repetition_RB, counts_RPV, seen_RPV, bitmask_RBW)
    tokens, logprobs = sample_tokens(logits_RBV, temperature_RB, top_p_RB, top_k_RB, min_p_RB, keys_RB2,
                                     min_tokens_RB, ban_RBS, choose, width=width)
    return tokens, logprobs, counted(counts_RPV, pen_slot_RB, tokens[:, : pen_slot_RB.shape[1]])


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
        runner.ensure_penalty_slots(max(slots, 1))  # (a runner shared by engines keeps the most any asked for)
        self.slots = runner.penalty_slots
        self.counts = runner.put(np.zeros((dp, self.slots, vocab_size), np.int32))
        self.seen = runner.put(np.zeros((dp, self.slots, vocab_size), np.bool_))
        self._padding: dict[int, list[jax.Array]] = {}  # by batch size: a step's controls and bitmask, all padding
        self._spec_padding: dict[tuple, jax.Array] = {}  # by shape: a speculative step's bitmasks, all ones

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

    def sample(self, logits, params: list, host: dict[str, np.ndarray], bitmask: np.ndarray | None, bits: int,
               width: int):
        """Sample the step (`params`: its sampling arrays on the device) with its rows' controls (`host`: the step's
        arrays, read when `bits` says a row has a bias or penalties; `bitmask`: None when no row of this node has a
        grammar), counting the tokens into the slots; returns tokens and logprobs."""
        put, B = self.runner.put, logits.shape[1]
        pad = self.padding(B)
        controls = [put(host[k]) for k in CONTROL_KEYS] if bits & BIAS_OR_PENALTY else pad[:-1]
        mask = pad[-1] if bitmask is None else put(bitmask)
        tokens, logprobs, self.counts = sample_with_controls(logits, *params, *controls, self.counts, self.seen, mask,
                                                             width=width)
        return tokens, logprobs

    def spec_inputs(self, host: dict[str, np.ndarray], bits: int, R: int) -> list:
        """A speculative step's controls, on the device: its R requests' rows of `host` (put when `bits` says a row
        has a bias or penalties), padding otherwise."""
        if bits & BIAS_OR_PENALTY:
            return [self.runner.put(np.ascontiguousarray(host[k][:, :R])) for k in CONTROL_KEYS]
        return self.padding(R)[:-1]

    def spec_padding(self, shape: tuple[int, ...]) -> jax.Array:
        """A speculative step's grammar bitmasks [dp, R, D + 1, W] allowing everything, on the device (put once)."""
        if shape not in self._spec_padding:
            self._spec_padding[shape] = self.runner.put(np.full(shape, -1, np.int32))
        return self._spec_padding[shape]

    def padding(self, B: int) -> list:
        """A step of B sequences' controls and bitmask with nothing in them, on the device (put once)."""
        if B not in self._padding:
            idle = empty_step(self.dp, 1, B, 1, 0)
            mask = np.full((self.dp, B, bitmask_words(self.vocab_size)), -1, np.int32)
            self._padding[B] = [self.runner.put(a) for a in (*(idle[k] for k in CONTROL_KEYS), mask)]
        return self._padding[B]

    def warm(self) -> None:
        """Compile and run `fill_slots` once on padding (`sample_with_controls` compiles with the steps:
        `jaxdp.engine.setup.compile_steps`)."""
        put = self.runner.put
        z = np.zeros(self.dp, np.int32)
        self.counts, self.seen = fill_slots(self.counts, self.seen, put(z - 1), put(z.astype(bool)),
                                            put(np.full((self.dp, FILL_CHUNK), -1, np.int32)),
                                            put(np.zeros((self.dp, FILL_CHUNK), np.bool_)))
        jax.block_until_ready(self.counts)
