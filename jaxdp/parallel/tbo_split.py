"""Two-batch overlap, on the host: where a rank's step splits into two micro-batches, and whether it can.

JAX-free (the schedulers and the agreement import it). SGLang's rules (`--enable-two-batch-overlap`,
`--tbo-token-distribution-threshold`, default 0.48):
- a decode step splits its sequences in two halves (the first `n // 2` rows, the rest);
- a prompt (extend) step splits at the sequence boundary that balances the two sides' tokens best (ties to the
  later boundary); when the smaller side would hold less than `threshold` of the tokens SGLang splits inside a
  sequence ("two-chunk overlap"), which jaxdp does not: such a rank cannot split, and since every rank must
  split alike, that step runs whole.
A rank with no rows can always split. The compiled micro-batch holds `micro_rows` rows: the larger side of a
split the threshold allows, so every split the host accepts fits the step's shapes (compiled at start-up).
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_THRESHOLD = 0.48  # SGLang's --tbo-token-distribution-threshold


def check_threshold(threshold: float) -> None:
    """Refuse a threshold outside (0, 0.5] in one sentence."""
    if not 0.0 < threshold <= 0.5:
        raise ValueError(f"--tbo-token-distribution-threshold {threshold} must be in (0, 0.5]: it is the smallest "
                         "share of a step's tokens either micro-batch may hold.")


def micro_rows(num_rows: int, threshold: float, absorbed: bool, tp: int = 1) -> int:
    """Rows of one compiled micro-batch of a step of `num_rows` rows per rank (a multiple of tp): half the rows
    for decode, the larger side the threshold allows for a prompt step."""
    share = 0.5 if absorbed else 1.0 - threshold
    m = max(1, math.ceil(num_rows * share - 1e-9))
    return -(-m // tp) * tp


def split_row(seq_T: np.ndarray, valid_T: np.ndarray, absorbed: bool, threshold: float,
              num_micro_rows: int) -> int | None:
    """The row where this rank's step splits (micro-batch 0 holds the rows before it), or None when it cannot
    split: a prompt step whose rows are not grouped by sequence, whose best boundary leaves a side under
    `threshold` of the tokens, or whose sides do not fit `num_micro_rows`."""
    valid = np.asarray(valid_T, bool)
    n = int(valid.sum())
    if n == 0:
        return 0
    if not valid[:n].all():  # the rows a rank reads come first, its padding after them
        return None
    seq = np.asarray(seq_T)[:n]
    if absorbed:
        s = n // 2
    else:
        if np.any(np.diff(seq) < 0):  # rows must come grouped by sequence, in order
            return None
        starts = np.flatnonzero(np.diff(seq)) + 1  # the sequence boundaries (rows)
        if starts.size == 0:
            return None  # one sequence: SGLang would split inside it (two-chunk), jaxdp does not
        key = 2 * np.abs(2 * starts - n) + (2 * starts < n)  # closest to half; a tie goes to the later boundary
        s = int(starts[np.argmin(key)])
        if min(s, n - s) < threshold * n:
            return None
    if s > num_micro_rows or n - s > num_micro_rows:
        return None
    return s


def split_bits(lens: list[int], threshold: float) -> int:
    """What a rank proposes (`jaxdp.parallel.agreement.Proposal.tbo`) for a batch of sequences of `lens` rows in
    the step's order: 1 when it splits as a decode step (one row each), 2 when it splits as an extend step (its
    prompt pieces, and decoders as one-token extends). Idle (no rows): both. The compiled micro-batch holds
    every split the threshold accepts (`micro_rows`), so fit is not checked here."""
    n = int(sum(lens))
    seq = np.repeat(np.arange(len(lens)), lens)
    valid = np.ones(n, bool)
    decode = all(k == 1 for k in lens)
    extend = split_row(seq, valid, False, threshold, n) is not None
    return (1 if decode else 0) | (2 if extend else 0)


def split_rows(seq_RT: np.ndarray, valid_RT: np.ndarray, absorbed: bool, threshold: float,
               num_micro_rows: int) -> np.ndarray | None:
    """Every rank's split row [dp], or None when some rank cannot split (then none does)."""
    rows = [split_row(s, v, absorbed, threshold, num_micro_rows) for s, v in zip(seq_RT, valid_RT, strict=True)]
    return None if any(r is None for r in rows) else np.asarray(rows, np.int32)
