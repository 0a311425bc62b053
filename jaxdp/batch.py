"""The arrays of one step for one rank, padded to a bucket: what the compiled step consumes.

A rank's step is a list of sequence pieces: each piece has the tokens it adds, the position of its
first token and the pages that hold its context. Padding tokens point at sequence B (none) and at a
cache slot past the end (their writes are dropped); padding sequences have length 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Piece:
    tokens: list[int]  # new tokens of this step (1 for a decode)
    start: int  # position of tokens[0]
    pages: list[int]  # pages of the whole context, in order


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
    """Pack pieces into arrays of T = num_rows token rows and B = num_seqs sequences."""
    n_tok = sum(len(p.tokens) for p in pieces)
    if n_tok > num_rows or len(pieces) > num_seqs:
        raise ValueError(f"{n_tok} tokens / {len(pieces)} sequences do not fit a bucket of "
                         f"{num_rows} rows / {num_seqs} sequences")
    T, B, N = num_rows, num_seqs, pages_per_seq
    out = RankBatch(
        tokens_T=np.zeros(T, np.int32), valid_T=np.zeros(T, bool), positions_T=np.zeros(T, np.int32),
        seq_T=np.full(T, B, np.int32), slots_T=np.full(T, num_pages * page_size, np.int32),
        page_table_BN=np.zeros((B, N), np.int32), seq_lens_B=np.zeros(B, np.int32),
        logits_idx_B=np.zeros(B, np.int32), num_rows=n_tok, num_seqs=len(pieces),
    )
    row = 0
    for b, p in enumerate(pieces):
        n = len(p.tokens)
        end = p.start + n
        if len(p.pages) * page_size < end or len(p.pages) > N:
            raise ValueError(f"sequence {b} needs {end} cache slots but has {len(p.pages)} pages "
                             f"(page table width {N})")
        pos = np.arange(p.start, end)
        out.tokens_T[row:row + n] = p.tokens
        out.valid_T[row:row + n] = True
        out.positions_T[row:row + n] = pos
        out.seq_T[row:row + n] = b
        pages = np.asarray(p.pages, np.int32)
        out.slots_T[row:row + n] = pages[pos // page_size] * page_size + pos % page_size
        out.page_table_BN[b, : len(pages)] = pages
        out.seq_lens_B[b] = end
        out.logits_idx_B[b] = row + n - 1
        row += n
    if all_logits:
        out.logits_idx_B = np.arange(T, dtype=np.int32)
    return out


def stack_ranks(batches: list[RankBatch]) -> dict[str, np.ndarray]:
    """Per-rank arrays stacked on a leading rank axis (sharded over `dp` by the step)."""
    fields = ("tokens_T", "valid_T", "positions_T", "seq_T", "slots_T", "page_table_BN", "seq_lens_B",
              "logits_idx_B")
    out = {f: np.stack([getattr(b, f) for b in batches]) for f in fields}
    out["rows_R"] = np.asarray([b.num_rows for b in batches], np.int32)
    return out
