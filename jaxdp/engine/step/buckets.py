"""Which compiled step a batch runs: decode buckets (SGLang's CUDA-graph batch sizes) and extend buckets.

Every rank runs the same shape (an SPMD program has one), chosen from the busiest rank. An extend step
of up to `max_len_rows` rows per rank pads every rank to the bucket (MAX_LEN); a larger one uses the
SUM_LEN exact buffer, whose size is itself bucketed (powers of two) so that every shape is known at
start-up and compiled ahead of time.

Under speculative decoding an extend step's request slots are bucketed apart from its rows (`slot_buckets`, from
the agreement's requests per rank, MAX over ranks): its accept, its D + 1 logits rows a request and its chained
drafts run over every slot, so a step of one prompt chunk of 64 rows takes 4 slots, not min(64, requests a rank).

The page table's width is bucketed too: a step's table holds as many pages per sequence as its longest
sequence needs, rounded up to a page bucket (PAGE_BUCKET_TOKENS, then x4 up to the whole context), not the
whole context's. At DeepSeek-V3's 163,840 tokens (2,560 pages of 64) a decode step of requests under 4k tokens
sends and gathers 64 pages a sequence, not 2,560 (widths 64, 256, 1,024, 2,560: four times the decode and
extend shapes to compile); the XLA attention reads what the bucket holds. A context of at most 4,096 tokens
has one width, as before.
"""

from __future__ import annotations

import bisect
import dataclasses

from jaxdp.parallel.accounting import decode_buckets
from jaxdp.parallel.agreement import Agreement
from jaxdp.parallel.step import StepShape
from jaxdp.parallel.tbo_split import micro_rows

PAGE_BUCKET_TOKENS = 4096  # the smallest page bucket covers this many tokens
PAGE_BUCKET_GROWTH = 4  # each next page bucket is this many times larger (fewer shapes to compile than x2)
SLOT_BUCKET_FIRST = 4  # a speculative extend step's request slots: 4, 16, 64, ... and the most its rows hold
SLOT_BUCKET_GROWTH = 4


def page_buckets(pages_per_seq: int, page_size: int) -> list[int]:
    """Page-table widths compiled: PAGE_BUCKET_TOKENS worth of pages, x4, ... and the whole context's."""
    out, n = [], -(-PAGE_BUCKET_TOKENS // page_size)
    while n < pages_per_seq:
        out.append(n)
        n *= PAGE_BUCKET_GROWTH
    return out + [pages_per_seq]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode: list[int]
    extend: list[int]
    max_seqs: int  # requests per rank
    dp: int
    max_len_rows: int
    pages: tuple[int, ...] = ()  # page-table widths (page_buckets); () until `with_pages`
    draft_tokens: int = 0  # speculative decoding: every step is a speculative one (jaxdp.parallel.spec_step)
    spec_off_above: int | None = None  # ... plain stretches (jaxdp.engine.step.spec): the plain shapes too
    tbo_threshold: float | None = None  # --enable-two-batch-overlap's threshold (None: off): the split shapes too
    tp: int = 1  # devices of an attention group (a micro-batch's rows are a multiple)

    @property
    def largest_decode_rows(self) -> int:
        """Rows per rank the largest decode bucket holds (a verify's draft_tokens + 1 a request)."""
        return self.decode[-1] * (self.draft_tokens + 1)

    def with_pages(self, pages_per_seq: int, page_size: int) -> Buckets:
        return dataclasses.replace(self, pages=tuple(page_buckets(pages_per_seq, page_size)))

    def page_bucket(self, pages: int) -> int:
        return self.pages[min(bisect.bisect_left(self.pages, pages), len(self.pages) - 1)]

    @classmethod
    def make(cls, max_running: int, chunk: int, dp: int, decode: list[int] | None = None,
             extend: list[int] | None = None, max_len_rows: int = 256, draft_tokens: int = 0,
             spec_off_above: int | None = None, tbo_threshold: float | None = None, tp: int = 1) -> Buckets:
        """draft_tokens: speculative decoding's; a verify of every running request, draft_tokens + 1 rows each,
        must fit the largest extend bucket. spec_off_above: --speculative-disable-by-batch-size. tbo_threshold:
        --tbo-token-distribution-threshold with --enable-two-batch-overlap (None: off); tp: an attention group's."""
        dec = sorted(decode) if decode else decode_buckets(max_running)
        rows = max(chunk, max_running * (draft_tokens + 1))
        top = _pow2(rows)
        ext = sorted(extend) if extend else [b for b in (1 << i for i in range(20)) if min(8, top) <= b <= top]
        if ext[-1] < rows:
            raise ValueError(f"the largest extend bucket {ext[-1]} is below the per-rank chunk {chunk} / batch "
                             f"{max_running} (x{draft_tokens + 1} rows a request when speculating); add a larger "
                             "bucket")
        return cls(dec, ext, max_running, dp, max_len_rows, draft_tokens=draft_tokens, spec_off_above=spec_off_above,
                   tbo_threshold=tbo_threshold, tp=tp)

    def extend_seqs(self, rows: int) -> int:
        return min(rows, self.max_seqs)

    def slot_buckets(self, rows: int) -> list[int]:
        """A speculative extend step's request-slot counts compiled for an extend bucket of `rows`: 4, 16, 64, ...
        below the most it can hold (extend_seqs), then that."""
        top, out, n = self.extend_seqs(rows), [], SLOT_BUCKET_FIRST
        while n < top:
            out.append(n)
            n *= SLOT_BUCKET_GROWTH
        return out + [top]

    def slot_bucket(self, rows: int, requests: int) -> int:
        ladder = self.slot_buckets(rows)
        return ladder[min(bisect.bisect_left(ladder, requests), len(ladder) - 1)]

    def extend_modes(self, rows: int) -> list[tuple[str, int]]:
        if rows <= self.max_len_rows or self.dp == 1:
            return [("max_len", 0)]
        return [("sum_len", s) for s in self._sum_len_sizes(rows)]

    def _sum_len_sizes(self, rows: int) -> list[int]:
        """Exact-buffer sizes compiled for an extend bucket: rows, 2 rows, 4 rows, ... up to dp rows."""
        sizes = [rows << i for i in range(self.dp.bit_length())]
        return [s for s in sizes if s < self.dp * rows] + [self.dp * rows]

    def shapes(self) -> list[StepShape]:
        """Every step shape a serving step may take (compiled at start-up)."""
        if self.draft_tokens:  # every step verifies, samples and drafts: as a decode (only verifies), or an extend
            rows = self.draft_tokens + 1  # (with spec_off_above, the plain steps of the plain stretches too)
            plain = self._plain_shapes() if self.spec_off_above is not None else []
            return plain + [StepShape(True, b * rows, b * rows, n, draft_tokens=self.draft_tokens)
                            for n in self.pages for b in self.decode] + [
                StepShape(False, t, b, n, m, s, draft_tokens=self.draft_tokens)
                for n in self.pages for t in self.extend for m, s in self.extend_modes(t) for b in self.slot_buckets(t)]
        return self._plain_shapes() + [self.prompt_logprob_shape()]

    def _plain_shapes(self) -> list[StepShape]:
        out = []
        for n in self.pages:
            out += [StepShape(True, b, b, n) for b in self.decode]
            for t in self.extend:
                out += [StepShape(False, t, self.extend_seqs(t), n, m, s) for m, s in self.extend_modes(t)]
        if self.tbo_threshold is not None:  # every split shape too, compiled at start-up like the rest
            out += list(dict.fromkeys(self.micro(s) for s in out if s.num_rows > 1))
        return out

    def micro(self, shape: StepShape) -> StepShape:
        """`shape` run as two micro-batches (two-batch overlap, `jaxdp.parallel.tbo`): each of `micro_rows` rows,
        gathering MAX_LEN per micro-batch (so the SUM_LEN variants of a bucket share one split shape)."""
        m = micro_rows(shape.num_rows, self.tbo_threshold, shape.absorbed, self.tp)
        return dataclasses.replace(shape, gather_mode="max_len", sum_rows=0, micro_rows=m)

    def prompt_logprob_shape(self) -> StepShape:
        """The extend step that returns the logits of every row (a step where some request asks for prompt
        logprobs): the largest extend bucket, padded (MAX_LEN), with the widest page table, so it adds one shape
        to compile, and the steps of requests that do not ask are not changed."""
        t = self.extend[-1]
        return StepShape(False, t, self.extend_seqs(t), self.pages[-1], all_logits=True)

    def shape_for(self, rows: list[int], agreement: Agreement, plain: bool = False) -> StepShape:
        """The compiled step of a batch. `plain`: under speculation, a plain stretch's step (`step.spec`)."""
        busiest, pages_per_seq = max(rows), self.page_bucket(agreement.max_pages)
        if self.draft_tokens and not plain:  # (a verify: up to draft_tokens + 1 rows a request, its token, drafts)
            if agreement.use_decode_bucket:
                per = self.draft_tokens + 1
                b = self.decode[bisect.bisect_left(self.decode, agreement.max_requests)]
                return StepShape(True, b * per, b * per, pages_per_seq, draft_tokens=self.draft_tokens)
            shape = self._extend_shape(rows, busiest, pages_per_seq)
            return dataclasses.replace(shape, num_seqs=self.slot_bucket(shape.num_rows, agreement.max_requests),
                                       draft_tokens=self.draft_tokens)
        if agreement.use_decode_bucket:
            b = self.decode[bisect.bisect_left(self.decode, busiest)]
            shape = StepShape(True, b, b, pages_per_seq)
        else:
            shape = self._extend_shape(rows, busiest, pages_per_seq)
        return self.micro(shape) if agreement.tbo and self.tbo_threshold is not None and shape.num_rows > 1 else shape

    def _extend_shape(self, rows: list[int], busiest: int, pages_per_seq: int) -> StepShape:
        t = self.extend[bisect.bisect_left(self.extend, busiest)]
        if t <= self.max_len_rows or self.dp == 1:
            return StepShape(False, t, self.extend_seqs(t), pages_per_seq)
        s = next(s for s in self._sum_len_sizes(t) if s >= sum(rows))
        return StepShape(False, t, self.extend_seqs(t), pages_per_seq, "sum_len", s)
