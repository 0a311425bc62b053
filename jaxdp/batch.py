"""The arrays of one step, padded to a bucket: what the compiled step (and the sampler) consume.

A rank's step is either a list of sequence pieces (prompt chunks: each piece has the tokens it adds, the
position of its first token and the pages that hold its context; `fill_pieces`) or rows of the persistent
batch of running requests (one token each; `jaxdp.engine.sched.rows`). Padding tokens point at sequence B (none)
and at a cache slot past the end (their writes are dropped); padding sequences have length 0 and sample
greedily.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdp.engine.sched.request import BAN_WIDTH, MAX_LOGIT_BIAS


@dataclasses.dataclass(frozen=True)
class StepArray:
    """One array of a step: its name, its shape as letters after the leading rank axis (T token rows, B
    sequences, N pages per sequence, L logits rows: B, or T when the step returns every row's logits, K the two
    words of a PRNG key), its dtype and what a padding entry holds (a number; "B": the sequence past the last,
    so a padding token belongs to none; "slot": a cache slot past the pool's end, so its write is dropped)."""

    name: str
    dims: str
    dtype: type
    pad: int | float | bool | str

    def shape(self, dp: int, sizes: dict[str, int]) -> tuple[int, ...]:
        return (dp, *(sizes[d] for d in self.dims))


# what the compiled step reads (`jaxdp.parallel.step`), in its argument order
STEP_SPEC = (StepArray("tokens_T", "T", np.int32, 0), StepArray("valid_T", "T", np.bool_, False),
             StepArray("positions_T", "T", np.int32, 0), StepArray("seq_T", "T", np.int32, "B"),
             StepArray("slots_T", "T", np.int32, "slot"), StepArray("page_table_BN", "BN", np.int32, 0),
             StepArray("seq_lens_B", "B", np.int32, 0), StepArray("logits_idx_B", "L", np.int32, 0))
# what the sampler reads (`jaxdp.engine.step.sampling`); a padding sequence samples greedily
SAMPLING_SPEC = (StepArray("temperature", "B", np.float32, 0.0), StepArray("top_p", "B", np.float32, 1.0),
                 StepArray("top_k", "B", np.int32, -1), StepArray("min_p", "B", np.float32, 0.0),
                 StepArray("keys", "BK", np.uint32, 0), StepArray("min_tokens", "B", np.int32, 0),
                 StepArray("ban", "BS", np.int32, -1))  # S: BAN_WIDTH ids min_tokens holds off
# what the sampling controls read (`jaxdp.engine.step.controls`), only in steps where some row has them: a row's
# logit bias (X: MAX_LOGIT_BIAS (id, bias) pairs, id -1 padded) and its penalties (its penalty slot, -1: none)
CONTROL_SPEC = (StepArray("bias_ids", "BX", np.int32, -1), StepArray("bias_values", "BX", np.float32, 0.0),
                StepArray("pen_slot", "B", np.int32, -1), StepArray("frequency", "B", np.float32, 0.0),
                StepArray("presence", "B", np.float32, 0.0), StepArray("repetition", "B", np.float32, 1.0))
# what a speculative step reads besides (`jaxdp.parallel.spec_step`): per request (R) its rows, its drafts (D), the
# token after a chunk that does not end its prompt, the slots of A = 2D - 1 positions ahead; per row (T) its request
SPEC_SPEC = (StepArray("req_T", "T", np.int32, "R"),  # the request of each row (padding: none)
             StepArray("drafts_RD", "RD", np.int32, 0),  # the draft tokens a verify offers
             StepArray("n_draft_R", "R", np.int32, 0),  # D for a verify, 0 for a prompt chunk
             StepArray("first_row_R", "R", np.int32, 0), StepArray("last_row_R", "R", np.int32, 0),
             StepArray("next_token_R", "R", np.int32, -1),  # a chunk's next prompt token; -1: the sampled one
             StepArray("live_R", "R", np.bool_, False),  # the request samples (its drafts are made)
             StepArray("ahead_slots_RA", "RA", np.int32, "slot"))  # slots of the A positions past its base
STEP_FIELDS = tuple(a.name for a in STEP_SPEC)
SAMPLING_KEYS = tuple(a.name for a in SAMPLING_SPEC)
CONTROL_KEYS = tuple(a.name for a in CONTROL_SPEC)
SPEC_FIELDS = tuple(a.name for a in SPEC_SPEC)


def step_sizes(num_rows: int, num_seqs: int, pages_per_seq: int, num_logits: int | None = None) -> dict[str, int]:
    """The sizes of the shape letters of `StepArray.dims`."""
    return {"T": num_rows, "B": num_seqs, "N": pages_per_seq, "L": num_seqs if num_logits is None else num_logits,
            "K": 2, "S": BAN_WIDTH, "X": MAX_LOGIT_BIAS}


def spec_sizes(num_rows: int, num_requests: int, draft_tokens: int) -> dict[str, int]:
    """The sizes of a speculative step's own arrays (SPEC_SPEC), and of its sampling arrays: one row a request."""
    return {"T": num_rows, "R": num_requests, "B": num_requests, "K": 2, "S": BAN_WIDTH, "D": draft_tokens,
            "A": 2 * draft_tokens - 1}


@dataclasses.dataclass
class Piece:
    tokens: list[int]  # new tokens of this step (1 for a decode)
    start: int  # position of tokens[0]
    pages: list[int]  # pages of the whole context, in order


def empty_step(dp: int, num_rows: int, num_seqs: int, pages_per_seq: int, pad_slot: int) -> dict[str, np.ndarray]:
    """All-padding arrays of a step, its sampling and its sampling controls: T = num_rows token rows and B = num_seqs
    sequences per rank."""
    sizes, fill = step_sizes(num_rows, num_seqs, pages_per_seq), {"B": num_seqs, "slot": pad_slot}
    return _filled((*STEP_SPEC, *SAMPLING_SPEC, *CONTROL_SPEC), dp, sizes, fill)


def empty_spec(dp: int, num_rows: int, num_requests: int, draft_tokens: int, pad_slot: int) -> dict[str, np.ndarray]:
    """All-padding arrays of a speculative step's own inputs and of its sampling (one row a request)."""
    sizes = spec_sizes(num_rows, num_requests, draft_tokens)
    return _filled((*SPEC_SPEC, *SAMPLING_SPEC), dp, sizes, {"R": num_requests, "slot": pad_slot})


def _filled(arrays, dp: int, sizes: dict[str, int], fill: dict[str, int]) -> dict[str, np.ndarray]:
    return {a.name: np.full(a.shape(dp, sizes), fill[a.pad] if isinstance(a.pad, str) else a.pad, a.dtype)
            for a in arrays}


def fill_pieces(out: dict[str, np.ndarray], r: int, pieces: list[Piece], page_size: int) -> None:
    """Rank r of a step's arrays from pieces (their sampling parameters are filled by the caller)."""
    T, B = out["tokens_T"].shape[1], out["seq_lens_B"].shape[1]
    N = out["page_table_BN"].shape[2]
    n_tok = sum(len(p.tokens) for p in pieces)
    if n_tok > T or len(pieces) > B:
        raise ValueError(f"{n_tok} tokens / {len(pieces)} sequences do not fit a bucket of {T} rows / {B} sequences")
    row = 0
    for b, p in enumerate(pieces):
        n = len(p.tokens)
        end = p.start + n
        if len(p.pages) * page_size < end or len(p.pages) > N:
            raise ValueError(f"sequence {b} needs {end} cache slots but has {len(p.pages)} pages "
                             f"(page table width {N})")
        pos = np.arange(p.start, end)
        out["tokens_T"][r, row:row + n] = p.tokens
        out["valid_T"][r, row:row + n] = True
        out["positions_T"][r, row:row + n] = pos
        out["seq_T"][r, row:row + n] = b
        pages = np.asarray(p.pages, np.int32)
        out["slots_T"][r, row:row + n] = pages[pos // page_size] * page_size + pos % page_size
        out["page_table_BN"][r, b, : len(pages)] = pages
        out["seq_lens_B"][r, b] = end
        out["logits_idx_B"][r, b] = row + n - 1
        row += n


@dataclasses.dataclass
class RankBatch:
    """numpy arrays of one rank: T token rows, B sequences, N pages per sequence."""

    tokens_T: np.ndarray
    valid_T: np.ndarray
    positions_T: np.ndarray
    seq_T: np.ndarray
    slots_T: np.ndarray
    page_table_BN: np.ndarray
    seq_lens_B: np.ndarray
    logits_idx_B: np.ndarray  # the row of each sequence's last new token (every row with all_logits)
    num_rows: int  # real token rows
    num_seqs: int


def build_rank_batch(pieces: list[Piece], *, num_rows: int, num_seqs: int, pages_per_seq: int,
                     page_size: int, num_pages: int, all_logits: bool = False) -> RankBatch:
    """Pack pieces into arrays of T = num_rows token rows and B = num_seqs sequences (one rank, standalone)."""
    out = empty_step(1, num_rows, num_seqs, pages_per_seq, num_pages * page_size)
    fill_pieces(out, 0, pieces, page_size)
    batch = RankBatch(**{f: out[f][0] for f in STEP_FIELDS}, num_rows=sum(len(p.tokens) for p in pieces),
                      num_seqs=len(pieces))
    if all_logits:
        batch.logits_idx_B = np.arange(num_rows, dtype=np.int32)
    return batch


def stack_ranks(batches: list[RankBatch]) -> dict[str, np.ndarray]:
    """Per-rank arrays stacked on a leading rank axis (sharded over `dp` by the step)."""
    out = {f: np.stack([getattr(b, f) for b in batches]) for f in STEP_FIELDS}
    out["rows_R"] = np.asarray([b.num_rows for b in batches], np.int32)
    return out
