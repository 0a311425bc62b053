"""The persistent batch (vLLM's InputBatch idea): the running requests of every rank as preallocated arrays.

`RunningRows` holds [dp, capacity] arrays; a rank's scheduler changes its own row of them (a `RankRows`
view) when a request joins (its prompt is read), takes a page, is sampled, or leaves. A row keeps its index
while its request runs (free rows are reused), so a step planned before another is booked still finds its
rows. A decode step reads the rows of every rank with a few vectorised operations (`fill_decodes`); nothing here is
rebuilt per step from Python lists.

Per row: the input token of its next decode (a real token, or -1-j: the j-th token of step `step` still on
the device), the context length that token completes, tokens generated (in flight included) and the limit
(max_new_tokens, or the context length), the page-table row, and the sampling parameters.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from jaxdp.batch import empty_step, fill_pieces
from jaxdp.engine.sched.request import BAN_WIDTH, MAX_LOGIT_BIAS, Request, SamplingParams

if TYPE_CHECKING:
    from jaxdp.engine.sched.rank_plan import RankPlan
    from jaxdp.parallel.step import StepShape

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ban", "bias_ids", "bias_values",
                   "pen_slot", "frequency", "presence", "repetition")
_SAMPLING_DTYPES = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "min_p": np.float32,
                    "seed": np.uint32, "min_tokens": np.int32, "pen_slot": np.int32, "frequency": np.float32,
                    "presence": np.float32, "repetition": np.float32}
_BIAS = ("bias_ids", "bias_values")
_NO_BIAS = (np.full(MAX_LOGIT_BIAS, -1, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32))
_MAX_TEMPERATURE = 1e4  # beyond this the distribution is uniform in float32 anyway


def sampling_row(params: SamplingParams, rid: str, engine_seed: int, vocab_size: int,
                 eos_token_ids: Iterable[int] = (), pen_slot: int = -1) -> tuple:
    """(temperature, top_p, top_k, min_p, seed, min_tokens, ban, bias_ids, bias_values, pen_slot, frequency,
    presence, repetition) of a request's row (SAMPLING_FIELDS), each within its array's range; `ban` [BAN_WIDTH]:
    the ids its min_tokens holds off (its stop token ids, and the model's `eos_token_ids` unless it ignores them),
    padded with -1 (all -1 without a min_tokens); its logit bias as MAX_LOGIT_BIAS ids (-1 padded) and biases;
    `pen_slot`: its penalty slot (the scheduler's booking; -1: no penalties) and the three penalties."""
    def unit(x, default: float) -> float:
        x = _real(x)
        return default if x != x else min(max(x, 0.0), 1.0)  # (x != x: NaN)

    t = _real(params.temperature)
    t = 0.0 if t != t or t <= 0 else min(t, _MAX_TEMPERATURE)
    k = _real(params.top_k)
    k = -1 if k != k or k <= 0 or k >= vocab_size else int(k)
    seed = params.seed if params.seed is not None else zlib.crc32(f"{engine_seed}:{rid}".encode())
    top_p = max(unit(params.top_p, 1.0), 1e-6)  # (a top_p of 0 would keep no token: keep the first)
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF  # the API's 64-bit range (n samples add to it), folded to the key's 32 bits
    ban = np.full(BAN_WIDTH, -1, np.int32)
    if params.min_new_tokens > 0:
        ids = list(dict.fromkeys([*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]))
        if len(ids) > BAN_WIDTH:  # (requests hold at most MAX_MIN_TOKENS_STOP_IDS; the model's eos ids are fewer)
            raise ValueError(f"{len(ids)} stop and end-of-sequence ids do not fit a row's {BAN_WIDTH}")
        ban[: len(ids)] = ids
    bias = _NO_BIAS
    if params.logit_bias:
        ids, values = np.full(MAX_LOGIT_BIAS, -1, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
        items = [(t, b) for t, b in params.logit_bias.items() if 0 <= t < vocab_size][:MAX_LOGIT_BIAS]
        ids[: len(items)] = [t for t, _ in items]
        values[: len(items)] = [b for _, b in items]
        bias = ids, values
    return (t, top_p, k, unit(params.min_p, 0.0), (seed ^ (seed >> 32)) & 0xFFFFFFFF, params.min_new_tokens, ban,
            *bias, pen_slot, params.frequency_penalty, params.presence_penalty, params.repetition_penalty)


def _real(x) -> float:
    """x as a float; an integer too large for one is +-inf (NaN stays NaN)."""
    try:
        return float(x)
    except OverflowError:
        return float("inf") if x > 0 else float("-inf")



@dataclasses.dataclass
class RowArrays:
    """The arrays, [dp, capacity] (the page table [dp, capacity, pages_per_seq]), or one rank's views of them."""

    occupied: np.ndarray
    token: np.ndarray
    step: np.ndarray  # the step that sampled `token` (-1: a real token)
    length: np.ndarray  # tokens of the context once `token` is in it
    n_out: np.ndarray  # output tokens, in flight included
    limit: np.ndarray  # n_out may not pass this (max_new_tokens, or the context length)
    num_pages: np.ndarray
    pages: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    min_tokens: np.ndarray
    ban: np.ndarray  # [dp, capacity, BAN_WIDTH]: the ids min_tokens holds off, -1 padded
    bias_ids: np.ndarray  # [dp, capacity, MAX_LOGIT_BIAS]: logit_bias's ids, -1 padded
    bias_values: np.ndarray  # ... and their biases
    pen_slot: np.ndarray  # the row's penalty slot (-1: none)
    frequency: np.ndarray
    presence: np.ndarray
    repetition: np.ndarray

    @classmethod
    def zeros(cls, dp: int, capacity: int, pages_per_seq: int) -> RowArrays:
        shape = (dp, capacity)
        return cls(np.zeros(shape, bool), np.zeros(shape, np.int32), np.full(shape, -1, np.int64),
                   np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32),
                   np.zeros(shape, np.int32), np.zeros((*shape, pages_per_seq), np.int32),
                   *(np.zeros(shape, _SAMPLING_DTYPES[f]) for f in SAMPLING_FIELDS[:6]),
                   np.full((*shape, BAN_WIDTH), -1, np.int32), np.full((*shape, MAX_LOGIT_BIAS), -1, np.int32),
                   np.zeros((*shape, MAX_LOGIT_BIAS), np.float32), np.full(shape, -1, np.int32),
                   np.zeros(shape, np.float32), np.zeros(shape, np.float32), np.ones(shape, np.float32))

    def rank(self, r: int) -> RowArrays:
        return RowArrays(*(getattr(self, f.name)[r] for f in dataclasses.fields(self)))


class RankRows:
    """One rank's rows of the persistent batch, and the requests in them."""

    def __init__(self, arrays: RowArrays, page_size: int):
        self.a = arrays
        self.page_size = page_size
        self.capacity, self.pages_per_seq = arrays.pages.shape
        self.reqs: list[Request | None] = [None] * self.capacity
        self._free = list(range(self.capacity - 1, -1, -1))  # lowest row first

    def __len__(self) -> int:
        return self.capacity - len(self._free)

    def join(self, req: Request, token: int, step: int, limit: int, sampling: tuple) -> int:
        """A request whose prompt is read starts decoding in a free row; its first output token (the last in
        output_ids) is `token`, sampled by `step`."""
        if len(req.pages) > self.pages_per_seq:
            raise ValueError(f"request {req.rid} holds {len(req.pages)} pages; a row has {self.pages_per_seq}")
        row = self._free.pop()
        a = self.a
        a.occupied[row], a.token[row], a.step[row] = True, token, step
        a.length[row], a.n_out[row], a.limit[row] = req.num_tokens, len(req.output_ids), limit
        a.num_pages[row] = len(req.pages)
        a.pages[row, : len(req.pages)] = req.pages
        for f, v in zip(SAMPLING_FIELDS, sampling, strict=True):
            getattr(a, f)[row] = v
        self.reqs[row] = req
        req.row = row
        return row

    def leave(self, req: Request) -> None:
        row = req.row
        self.a.occupied[row] = False
        self.reqs[row] = None
        self._free.append(row)
        req.row = -1

    def add_pages(self, req: Request, pages: list[int]) -> None:
        row, n = req.row, self.a.num_pages[req.row]
        self.a.pages[row, n: n + len(pages)] = pages
        self.a.num_pages[row] = n + len(pages)
        req.pages += pages

    def decodable(self) -> np.ndarray:
        """Rows that decode next: running, and their in-flight token does not end them."""
        return np.nonzero(self.a.occupied & (self.a.n_out < self.a.limit))[0]

    def needing_page(self, rows: np.ndarray) -> np.ndarray:
        """Those of `rows` whose next token starts a new page."""
        return rows[self.a.length[rows] > self.a.num_pages[rows] * self.page_size]

    def sampled(self, rows: np.ndarray, step: int, first: int = 0) -> np.ndarray:
        """Rows `rows` are sampled by `step` as its sequences first, first + 1, ... (their tokens become its
        markers); returns their output positions."""
        a = self.a
        out_pos = a.n_out[rows].copy()
        a.token[rows] = -1 - first - np.arange(len(rows), dtype=np.int32)
        a.step[rows] = step
        a.n_out[rows] += 1
        a.length[rows] += 1
        return out_pos

    def booked(self, rows: np.ndarray, step: int, tokens: np.ndarray) -> None:
        """Step `step`'s tokens replace its markers, in the rows no later step has sampled since."""
        mine = rows >= 0  # (-1: a prompt chunk that samples nothing)
        mine[mine] = self.a.step[rows[mine]] == step  # (a row left since is never read: harmless)
        self.a.token[rows[mine]] = tokens[mine]
        self.a.step[rows[mine]] = -1


def fill_sampling(out: dict[str, np.ndarray], r, at, temperature, top_p, top_k, min_p, seed, min_tokens, ban,
                  bias_ids, bias_values, pen_slot, frequency, presence, repetition, n_out) -> None:
    """The sampling parameters (and controls) of rank r's sequences `at`; a row's key is (seed, tokens generated so
    far). The logit bias pairs of one sequence (`at` an int), None when the caller copies them."""
    out["min_tokens"][r, at] = min_tokens
    out["ban"][r, at] = ban
    if bias_ids is not None and bias_ids[0] >= 0:  # (one row's; `fill_decodes` copies its rows' itself)
        out["bias_ids"][r, at], out["bias_values"][r, at] = bias_ids, bias_values
    out["pen_slot"][r, at] = pen_slot
    out["frequency"][r, at] = frequency
    out["presence"][r, at] = presence
    out["repetition"][r, at] = repetition
    out["temperature"][r, at] = temperature
    out["top_p"][r, at] = top_p
    out["top_k"][r, at] = top_k
    out["min_p"][r, at] = min_p
    out["keys"][r, at, 0] = seed
    out["keys"][r, at, 1] = n_out


def plan_arrays(plans: list[RankPlan | None], rows: RowArrays, shape: StepShape, page_size: int,
                pad_slot: int) -> dict[str, np.ndarray]:
    """A step's arrays (and its sampling parameters) from every rank's plan: the decode plans of all ranks
    at once from the persistent rows, a plan of prompt chunks from its pieces; ranks without one stay padding."""
    out = empty_step(len(plans), shape.num_rows, shape.num_seqs, shape.pages_per_seq, pad_slot)
    decodes = [(r, p.rows, p.num_rows - len(p.rows), len(p.pieces)) for r, p in enumerate(plans)
               if p is not None and p.rows is not None and len(p.rows)]  # (a mixed chunk's after its pieces)
    if decodes:
        fill_decodes(out, rows, decodes, page_size)
    for r, plan in enumerate(plans):
        if plan is not None and plan.pieces:
            fill_pieces(out, r, plan.pieces, page_size)
            for b, (req, sampling, piece) in enumerate(zip(plan.reqs, plan.sampling, plan.pieces, strict=False)):
                fill_sampling(out, r, b, *sampling, len(req.output_ids))
                if piece.start + len(piece.tokens) < req.num_tokens:  # a chunk that samples nothing counts nothing
                    out["pen_slot"][r, b] = -1
    return out


def fill_decodes(out: dict[str, np.ndarray], a: RowArrays, decodes: list[tuple[int, np.ndarray, int, int]],
                 page_size: int) -> None:
    """Ranks' rows of the persistent batch (one token each) into a step's arrays, every rank in one go: as a
    decode step, or as one-token extends beside a rank that reads a prompt (or after its own prompt pieces:
    a mixed chunk). decodes: (rank, its rows, the token row and the sequence its first row takes)."""
    counts = np.asarray([len(d[1]) for d in decodes])
    r = np.repeat(np.asarray([d[0] for d in decodes]), counts)
    row = np.concatenate([d[1] for d in decodes])
    i = np.arange(len(row)) - np.repeat(np.cumsum(counts) - counts, counts)
    t = i + np.repeat(np.asarray([d[2] for d in decodes]), counts)
    seq = (i + np.repeat(np.asarray([d[3] for d in decodes]), counts)).astype(np.int32)
    pos = a.length[r, row] - 1
    table = a.pages[r, row]
    S = page_size
    out["tokens_T"][r, t] = a.token[r, row]
    out["valid_T"][r, t] = True
    out["positions_T"][r, t] = pos
    out["seq_T"][r, t] = seq
    out["slots_T"][r, t] = table[np.arange(len(row)), pos // S] * S + pos % S
    out["page_table_BN"][r, seq] = table[:, : out["page_table_BN"].shape[2]]  # (the step's page bucket)
    out["seq_lens_B"][r, seq] = pos + 1
    out["logits_idx_B"][r, seq] = t
    fill_sampling(out, r, seq, *(None if f in _BIAS else getattr(a, f)[r, row] for f in SAMPLING_FIELDS),
                  a.n_out[r, row])
    biased = a.bias_ids[r, row, 0] >= 0  # (most rows have no logit bias: only theirs are copied)
    if biased.any():
        rb, rowb, seqb = r[biased], row[biased], seq[biased]
        out["bias_ids"][rb, seqb], out["bias_values"][rb, seqb] = a.bias_ids[rb, rowb], a.bias_values[rb, rowb]
