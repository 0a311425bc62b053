"""The arrays of one step, padded to a bucket: what the compiled step (and the sampler) consume.

A rank's step is either a list of sequence pieces (prompt chunks: each piece has the tokens it adds, the
position of its first token and the pages that hold its context; `fill_pieces`) or rows of the persistent
batch of running requests (one token each; `jaxdp.engine.rows`). Padding tokens point at sequence B (none)
and at a cache slot past the end (their writes are dropped); padding sequences have length 0 and sample
greedily.
"""

from __future__ import annotations

import dataclasses

import numpy as np

STEP_FIELDS = ("tokens_T", "valid_T", "positions_T", "seq_T", "slots_T", "page_table_BN", "seq_lens_B",
               "logits_idx_B")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "keys")


@dataclasses.dataclass
class Piece:
    tokens: list[int]  # new tokens of this step (1 for a decode)
    start: int  # position of tokens[0]
    pages: list[int]  # pages of the whole context, in order


def empty_step(dp: int, num_rows: int, num_seqs: int, pages_per_seq: int, pad_slot: int) -> dict[str, np.ndarray]:
    """All-padding arrays of a step: T = num_rows token rows and B = num_seqs sequences per rank."""
    T, B, N = num_rows, num_seqs, pages_per_seq
    return {"tokens_T": np.zeros((dp, T), np.int32), "valid_T": np.zeros((dp, T), bool),
            "positions_T": np.zeros((dp, T), np.int32), "seq_T": np.full((dp, T), B, np.int32),
            "slots_T": np.full((dp, T), pad_slot, np.int32), "page_table_BN": np.zeros((dp, B, N), np.int32),
            "seq_lens_B": np.zeros((dp, B), np.int32), "logits_idx_B": np.zeros((dp, B), np.int32),
            "temperature": np.zeros((dp, B), np.float32), "top_p": np.ones((dp, B), np.float32),
            "top_k": np.full((dp, B), -1, np.int32), "min_p": np.zeros((dp, B), np.float32),
            "keys": np.zeros((dp, B, 2), np.uint32)}


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
