"""The speculative step (MTP / EAGLE with topk 1): verify, accept and draft in one compiled `shard_map`.

Every sequence of a rank is a piece of rows, as in an extend step: a prompt chunk, or a verify (the request's
last token and its D draft tokens at the next D positions). Per rank, the step:

1. runs the target model over the rows (the expanded MLA path, the places of `jaxdp.parallel.places` as in
   every step), writing their latents, and takes the logits of D + 1 rows per sequence (a verify's every row;
   a prompt's last row) and the final normed hidden state of every row;
2. accepts (`jaxdp.engine.step.spec_sampling.verify_row`): a verify keeps its leading drafts the target agrees
   with (greedy: equal to its argmax; sampling: rejection sampling against the request's own filtered
   distribution) and adds the target's next token; a prompt that ends in this chunk only samples its first
   token. The tokens a request gets are distributed as without speculation (greedy: identical);
3. drafts the next D tokens with the MTP layer: one pass over the same rows (row i: the target's hidden state
   of row i and the token that follows it, the sampled one after the last accepted row), which writes the
   draft KV of the accepted positions, then D - 1 one-row steps chained on the draft's own normed hidden state
   (SGLang's choice), each writing the draft KV of its position (`ahead_slots_BA`, pages the scheduler holds).

Rows a verify rejected leave latents past the request's accepted length, in its own pages: the next verify
starts at the first of them and writes them again before anything reads them (attention reads only positions
up to its own row), so they are given back simply by the request's length not covering them. Ranks with no
sequences run the same program on padding (the idle draft and verify steps); the gather before the MoE counts
each rank's rows (`rows_R`) in the target pass and the MTP pass, and its live sequences (`seqs_R`) in the chained
steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp.batch import (
    CONTROL_KEYS,
    CONTROL_SPEC,
    SAMPLING_SPEC,
    SPEC_SPEC,
    STEP_FIELDS,
    STEP_SPEC,
    empty_step,
    spec_sizes,
    step_sizes,
)
from jaxdp.engine.step.controls import allowed_tokens, bitmask_words, counted_verify, prepare_verify
from jaxdp.engine.step.sampling import filtered_probs
from jaxdp.engine.step.spec_sampling import verify_row
from jaxdp.model.mla import AttnBatch
from jaxdp.parallel import packing
from jaxdp.parallel.draft_kv import join_draft, split_draft
from jaxdp.parallel.packing import Layout, pack, unpack
from jaxdp.parallel.places import ALL, GatherSpec, MeshComm, ragged_a2a_on
from jaxdp.parallel.sharding import lm_head_mode


def _accept(logits_BJV, choose_BJV, drafts_BD, n_draft_B, temperature, top_p, top_k, min_p, keys_B2):
    """Per request (B of them here): tokens [B, D + 1] (the accepted drafts, the next token, -1 after), accepted
    drafts [B] and the log-probability of each token under the unmodified distribution [B, D + 1]. The target's
    distribution is the request's over `choose_BJV` (the logits with its sampling controls, `prepare_verify`)."""
    greedy_BJ = jnp.argmax(choose_BJV, axis=-1).astype(jnp.int32)
    is_greedy = temperature == 0

    def probs():
        f = jax.vmap(jax.vmap(filtered_probs, in_axes=(0, None, None, None, None)))
        return f(choose_BJV, temperature, top_p, top_k, min_p)

    # every row greedy (the common case): no distribution to build; the point masses make it exact anyway
    p_BJV = jax.lax.cond(jnp.all(is_greedy), lambda: jax.nn.one_hot(greedy_BJ, logits_BJV.shape[-1]), probs)
    keys = jax.vmap(lambda k: jax.random.wrap_key_data(k, impl="threefry2x32"))(keys_B2)
    tokens_BJ, accepted_B = jax.vmap(verify_row, in_axes=(0, None, 0, 0, 0, 0, 0))(
        p_BJV, None, drafts_BD, greedy_BJ, is_greedy, keys, n_draft_B)
    lp_BJV = jax.nn.log_softmax(logits_BJV.astype(jnp.float32), axis=-1)
    logprobs_BJ = jnp.take_along_axis(lp_BJV, jnp.maximum(tokens_BJ, 0)[..., None], axis=-1)[..., 0]
    return tokens_BJ, accepted_B, logprobs_BJ


def _outputs(tokens_RJ, accepted_R, logprobs_RJ, drafts_RD, main, draft_kv, rows_E, counts_PV):
    """A rank's step outputs (with the leading rank axis): tokens, tokens per request, their log-probabilities, the
    next drafts (-1: none), the pool (the main latents and the draft KV), rows per expert and the penalty counts."""
    cache = join_draft(main, draft_kv)
    out = (tokens_RJ, accepted_R + 1, logprobs_RJ, drafts_RD)
    return (*(a[None] for a in out), {k: v[None] for k, v in cache.items()}, rows_E[None], counts_PV[None])


def build_spec_step(runner, shape):
    """The jitted speculative step of `shape` (a StepShape with draft_tokens D) for `runner` (a StepRunner with
    a draft model). `shape.absorbed`: every rank only verifies, and each verify row is a sequence of its own
    (its request's page table, its own length: causal inside the verify), so the target and the MTP pass run
    the absorbed decode form; otherwise the rows are pieces as in an extend step (a prompt chunk somewhere)."""
    lay, cfg = runner.layout, runner.cfg
    D, T, R, absorbed = shape.draft_tokens, shape.num_rows, shape.num_requests, shape.absorbed
    J = D + 1  # logits rows a request
    gather = GatherSpec(shape.gather_mode, lay.dp, lay.tp, shape.sum_rows)
    chain_gather = GatherSpec("max_len", lay.dp, lay.tp)
    lm_mode, tied = lm_head_mode(lay), cfg.tie_word_embeddings
    graphdef, draft_graphdef, decode_kernel = runner.graphdef, runner.draft_graphdef, runner.decode_kernel
    ep_ragged = ragged_a2a_on(runner.mesh.devices.flat[0].platform)
    fixed_tree = getattr(decode_kernel, "batch_invariant", False)  # (--enable-deterministic-inference)

    def per_device(state, draft_state, cache, batch, spec, sampling, rows_R, seqs_R, controls, counts_PV, seen_PV,
                   bitmask_RJW):
        b = {k: v[0] for k, v in batch.items()}
        s = {k: v[0] for k, v in spec.items()}
        smp = {k: v[0] for k, v in sampling.items()}
        ctl = {k: v[0] for k, v in controls.items()}
        counts_PV, seen_PV, bitmask_RJW = counts_PV[0], seen_PV[0], bitmask_RJW[0]
        cache = {k: v[0] for k, v in cache.items()}
        main, draft_kv = split_draft(cache)
        comm = MeshComm(gather, lay.moe, lay.dense_replicated, lm_mode, T, rows_R, tied, ep_ragged,
                        fixed_tree=fixed_tree)
        model = nnx.merge(graphdef, state)
        attn = AttnBatch(b["positions_T"], b["seq_T"], b["slots_T"], b["page_table_BN"], b["seq_lens_B"])
        first, last, n_draft = s["first_row_R"], s["last_row_R"], s["n_draft_R"]
        # the logits rows: a verify's D + 1 rows; a prompt chunk's last row, D + 1 times
        lead_R = last - first - n_draft  # the rows before the first one a verify may reject (a prompt: all but one)
        j = jnp.arange(J)
        rows_RJ = first[:, None] + jnp.minimum(lead_R[:, None] + j[None], (last - first)[:, None])
        logits_LV, main, rows_E, hidden_TD = model(b["tokens_T"], b["valid_T"], attn, main, rows_RJ.reshape(-1),
                                                   comm, absorbed=absorbed, decode_kernel=decode_kernel,
                                                   return_hidden=True)
        logits_RJV = logits_LV.reshape(R, J, -1)
        drafts_RD = s["drafts_RD"][:, : J - 1]
        # each position's logits as plain decoding would see them (the drafts before it accepted): the controls
        choose_RJV = prepare_verify(logits_RJV, drafts_RD, n_draft, smp["keys"][:, 1].astype(jnp.int32),
                                    smp["min_tokens"], smp["ban"], *(ctl[k] for k in CONTROL_KEYS), counts_PV, seen_PV)
        # a grammar's masks: position j allows what the grammar allows after drafts 0..j-1 (a draft it does not
        # allow is left out of its own position, so it is never accepted); padding (all ones) pays the cond only
        masked = lambda: jnp.where(allowed_tokens(bitmask_RJW, choose_RJV.shape[-1]), choose_RJV, -jnp.inf)  # noqa: E731
        choose_RJV = jax.lax.cond(jnp.any(bitmask_RJW != -1), masked, lambda: choose_RJV)
        tokens_RJ, accepted_R, logprobs_RJ = _accept(logits_RJV, choose_RJV, drafts_RD, n_draft, smp["temperature"],
                                                     smp["top_p"], smp["top_k"], smp["min_p"], smp["keys"])
        counts_PV = counted_verify(counts_PV, ctl["pen_slot"], s["live_R"], tokens_RJ)  # (only what it gets)
        following_R = jnp.take_along_axis(tokens_RJ, accepted_R[:, None], axis=1)[:, 0]
        next_R = jnp.where(s["next_token_R"] >= 0, s["next_token_R"], following_R)
        accrow_R = lead_R + accepted_R  # the last accepted row of each request, from its first

        # the MTP pass over the step's rows: row i reads the token after it (the sampled one after accrow)
        req_T = jnp.minimum(s["req_T"], R - 1)
        i_T = jnp.arange(T) - first[req_T]
        acc_T = accrow_R[req_T]
        after_T = jnp.concatenate([b["tokens_T"][1:], jnp.zeros((1,), jnp.int32)])
        mtp_tokens_T = jnp.where(i_T < acc_T, after_T, jnp.where(i_T == acc_T, next_R[req_T], 0))
        mtp_valid_T = b["valid_T"] & (i_T <= acc_T)
        drafter = nnx.merge(draft_graphdef, draft_state)
        embed, head = model.embed_VD[...], model.lm_head_weight()
        at_R = first + accrow_R
        d_logits_RV, h_TD, draft_kv, _ = drafter(mtp_tokens_T, hidden_TD, mtp_valid_T, attn, draft_kv, at_R, comm,
                                                 embed, head, absorbed=absorbed, decode_kernel=decode_kernel)
        drafts = [jnp.argmax(d_logits_RV, axis=-1).astype(jnp.int32)]
        h_RD = drafter.shared_norm(h_TD[at_R])
        # the chained one-row steps, at the positions after the last accepted one
        chain = MeshComm(chain_gather, lay.moe, lay.dense_replicated, lm_mode, R, seqs_R, tied, ep_ragged,
                         fixed_tree=fixed_tree)
        pos_R = b["positions_T"][first] + accrow_R
        table_RN = b["page_table_BN"][first] if absorbed else b["page_table_BN"]  # (absorbed: a row's is its request's)
        reqs = jnp.arange(R, dtype=jnp.int32)
        for step in range(1, D):
            p_R = pos_R + step
            slot_R = jnp.take_along_axis(s["ahead_slots_RA"], (accepted_R + step - 1)[:, None], axis=1)[:, 0]
            one = AttnBatch(p_R, reqs, slot_R, table_RN, p_R + 1)
            d_logits_RV, h_RD, draft_kv, _ = drafter(drafts[-1], h_RD, s["live_R"], one, draft_kv, reqs, chain, embed,
                                                     head, absorbed=True, decode_kernel=decode_kernel)
            drafts.append(jnp.argmax(d_logits_RV, axis=-1).astype(jnp.int32))
            h_RD = drafter.shared_norm(h_RD)
        return _outputs(tokens_RJ, accepted_R, logprobs_RJ, jnp.stack(drafts, axis=1), main, draft_kv, rows_E,
                        counts_PV)

    dp_spec = P("dp")
    fn = jax.shard_map(
        per_device, mesh=runner.mesh,
        in_specs=(runner.state_specs, runner.draft_specs, {k: dp_spec for k in runner.cache},
                  {k: dp_spec for k in STEP_FIELDS}, {a.name: dp_spec for a in SPEC_SPEC},
                  {a.name: dp_spec for a in SAMPLING_SPEC}, P(), P(), {k: dp_spec for k in CONTROL_KEYS}, dp_spec,
                  dp_spec, dp_spec),
        out_specs=(dp_spec, dp_spec, dp_spec, dp_spec, {k: dp_spec for k in runner.cache}, P(ALL), dp_spec),
        check_vma=False)
    layout = packed_layout(shape)

    def step(state, draft_state, cache, packed_RW, counts_2R, controls, pen_counts_RPV, seen_RPV, bitmask_RRJW):
        arrays = unpack(packed_RW, layout)
        groups = ({k: arrays[k] for k in STEP_FIELDS}, {a.name: arrays[a.name] for a in SPEC_SPEC},
                  {a.name: arrays[a.name] for a in SAMPLING_SPEC})
        return fn(state, draft_state, cache, *groups, counts_2R[0], counts_2R[1], controls, pen_counts_RPV, seen_RPV,
                  bitmask_RRJW)

    return jax.jit(step, donate_argnums=(2, 6))


PACKED = (*STEP_SPEC, *SPEC_SPEC, *SAMPLING_SPEC)  # a speculative step's per-rank inputs, in their packed order


@functools.cache
def packed_layout(shape) -> Layout:
    """Where each per-rank input of a speculative step of `shape` lies in its packed [dp, W] int32 array
    (`jaxdp.parallel.packing`): one host-to-device transfer a step, not 21."""
    step = step_sizes(shape.num_rows, shape.num_seqs, shape.pages_per_seq)
    own = spec_sizes(shape.num_rows, shape.num_requests, shape.draft_tokens)  # (sampling: one row a request)
    return packing.packed_layout(PACKED, lambda a: step if a in STEP_SPEC else own)


def spec_abstract_args(runner, shape):
    """The speculative step's arguments as ShapeDtypeStructs (to compile it ahead of time): the weights, the pool,
    the packed inputs, rows and live requests per rank, the sampling controls of its requests, the penalty
    state (`runner.penalty_slots` slots a rank, `jaxdp.engine.step.controls`) and the grammar's bitmasks
    [dp, R, D + 1, ceil(V/32)] (`spec_bitmask_shape`)."""
    dp, sh = runner.layout.dp, NamedSharding(runner.mesh, P("dp"))
    packed = jax.ShapeDtypeStruct((dp, packing.width(packed_layout(shape))), jnp.int32, sharding=sh)
    counts = jax.ShapeDtypeStruct((2, dp), jnp.int32, sharding=NamedSharding(runner.mesh, P()))
    sizes = step_sizes(shape.num_rows, shape.num_requests, 1)  # (the controls: one row a request)
    controls = {a.name: jax.ShapeDtypeStruct(a.shape(dp, sizes), a.dtype, sharding=sh) for a in CONTROL_SPEC}
    state = (dp, runner.penalty_slots, runner.cfg.vocab_size)
    return (runner.state, runner.draft_state, runner.cache, packed, counts, controls,
            jax.ShapeDtypeStruct(state, jnp.int32, sharding=sh), jax.ShapeDtypeStruct(state, jnp.bool_, sharding=sh),
            jax.ShapeDtypeStruct(spec_bitmask_shape(runner, shape), jnp.int32, sharding=sh))


def spec_bitmask_shape(runner, shape) -> tuple[int, int, int, int]:
    """A speculative step's grammar bitmasks: [dp, R, D + 1, ceil(V/32)] (all ones: no grammar)."""
    return (runner.layout.dp, shape.num_requests, shape.draft_tokens + 1, bitmask_words(runner.cfg.vocab_size))


def run_spec_step(runner, shape, arrays: dict[str, np.ndarray], controls=None, bits: int = 0,
                  bitmask: np.ndarray | None = None):
    """Queue one speculative step: returns device arrays (tokens [dp, R, D + 1], tokens per request [dp, R],
    their log-probabilities [dp, R, D + 1], the next drafts [dp, R, D], rows per expert). Two host-to-device
    transfers: the packed per-rank inputs, and rows and live requests per rank; a third of the requests' logit
    biases and penalties when `bits` (the agreement's `controls`) says a row has them. `controls`: the engine's
    `SamplingControls`, whose penalty counts the step reads and replaces; None (start-up's idle runs) passes a
    state of zeros. `bitmask`: the grammar's masks [dp, R, D + 1, W] (a fourth transfer), None for none (padding
    kept on the device)."""
    runner.compile(shape)
    packed = runner.put(pack(arrays, packed_layout(shape)))
    counts = runner.put(np.stack([np.asarray(arrays["rows_R"], np.int32), np.asarray(arrays["seqs_R"], np.int32)]),
                        P())
    R = shape.num_requests
    if controls is None:
        dp, state = runner.layout.dp, (runner.layout.dp, runner.penalty_slots, runner.cfg.vocab_size)
        idle = empty_step(dp, 1, R, 1, 0)
        rows = dict(zip(CONTROL_KEYS, (runner.put(idle[k]) for k in CONTROL_KEYS), strict=True))
        pen = runner.put(np.zeros(state, np.int32)), runner.put(np.zeros(state, np.bool_))
        mask = runner.put(np.full(spec_bitmask_shape(runner, shape), -1, np.int32) if bitmask is None else bitmask)
    else:
        rows = dict(zip(CONTROL_KEYS, controls.spec_inputs(arrays, bits, R), strict=True))
        pen = controls.counts, controls.seen
        mask = controls.spec_padding(spec_bitmask_shape(runner, shape)) if bitmask is None else runner.put(bitmask)
    *out, runner.cache, rows_E, pen_counts = runner.executable(shape)(runner.state, runner.draft_state, runner.cache,
                                                                      packed, counts, rows, *pen, mask)
    if controls is not None:
        controls.counts = pen_counts
    runner.last_account = runner.account(shape, arrays["rows_R"])
    return (*out, rows_E)
