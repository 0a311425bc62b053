"""What one step costs where "each rank has its own rows" meets "all ranks compute this together".

Pure Python (no JAX): the planner calls it for real model sizes, the engine once per step to export
metrics. For a Layout, a ModelConfig and the rows of each DP rank it gives the gather mode, the bytes of
every collective per layer and per step, and rows computed against rows needed in attention, experts and
the LM head, both as SGLang computes them (padding rows go through the experts) and as jaxdp does
(the router masks padding rows, so experts compute only needed rows).

Conventions
- A row is one token position in this step: hidden_size numbers of `act_bytes` each.
- The bytes of a collective are the bytes of the full buffer it works on, on one device: the gathered
  output of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce, the send buffer of
  an all-to-all. This is the article's convention: the balanced gather on 4 ranks of GLM-5 is
  64 rows x 12,288 B = 768 KiB. `Collective.wire_bytes` estimates what one device sends (ring algorithms).
- Rows "per rank" are rows per attention group (DP rank); with tp > 1 every device of a group holds them.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only the attributes are read; importing jaxdp.layout would import JAX
    from jaxdp.config import ModelConfig
    from jaxdp.layout import Layout

MAX_LEN, SUM_LEN, NO_GATHER = "max_len", "sum_len", "none"
DECODE, EXTEND, IDLE = "decode", "extend", "idle"
AGREEMENT_INTS = 10  # int32 per rank exchanged before every step (SGLang's ten numbers)


def decode_buckets(max_bs: int = 512) -> list[int]:
    """SGLang's default decode CUDA-graph batch sizes (52 of them up to 512)."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


def extend_buckets(max_tokens: int = 2048) -> list[int]:
    """SGLang's default prompt (extend) graph token counts: 42 of them from 4 to 2,048."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256), *range(4608, max_tokens + 1, 512)]
    sizes = [s for s in sizes if s <= max_tokens]
    if max_tokens not in sizes:
        sizes.append(max_tokens)
    return sizes


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `rows`, or None when the step runs unrecorded."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


# ---- the article's five situations ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Situation:
    name: str
    rows: tuple[int, ...]
    kind: str  # DECODE or EXTEND
    lm_rows: tuple[int, ...] | None = None  # rows that need logits (one per sequence in a prompt step)


def five_situations(dp: int = 4, scale: float = 1.0) -> dict[str, Situation]:
    """The article's situations for `dp` ranks, rows multiplied by `scale` (nonzero rows stay >= 1).

    Scaled-down tests should scale the bucket limits too (`extend_max_tokens=int(2048 * scale)`), so that
    the long prompt still exceeds the largest extend bucket and the short one still fits.
    """
    def s(n: int) -> int:
        return max(1, round(n * scale)) if n else 0

    def rest(first: int, other: int) -> tuple[int, ...]:
        return (s(first),) + (s(other),) * (dp - 1)

    prompt_lm = (1,) + (s(16),) * (dp - 1)
    return {
        "balanced": Situation("balanced", rest(16, 16), DECODE),
        "single": Situation("single", rest(1, 0), DECODE),
        "skewed": Situation("skewed", rest(40, 8), DECODE),
        "short_prompt": Situation("short_prompt", rest(512, 16), EXTEND, prompt_lm),
        "long_prompt": Situation("long_prompt", rest(4096, 16), EXTEND, prompt_lm),
    }


FIVE_SITUATIONS: dict[str, Situation] = five_situations()


# ---- results ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Collective:
    name: str  # gather, return, attn_group_scatter, attn_group_gather, attn_allreduce, mlp_allreduce,
    #            dispatch, combine, lm_gather, logits, agreement
    op: str  # all_gather, reduce_scatter, all_reduce, all_to_all, cpu_all_gather
    group: int  # devices (or ranks, for the agreement) taking part
    buffer_bytes: int  # the buffer on one device, per call
    calls: int  # per step (layers it runs in, or 1)

    @property
    def bytes_per_step(self) -> int:
        return self.buffer_bytes * self.calls

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per call with ring algorithms."""
        if self.group <= 1:
            return 0.0
        share = (self.group - 1) / self.group
        return self.buffer_bytes * share * (2 if self.op == "all_reduce" else 1)


@dataclasses.dataclass(frozen=True)
class RowCount:
    computed: int
    needed: int

    @property
    def ratio(self) -> float:
        return self.computed / self.needed if self.needed else 1.0


@dataclasses.dataclass(frozen=True)
class StepAccount:
    rows: tuple[int, ...]  # per DP rank
    kind: str  # decode | extend | idle
    gather_mode: str  # max_len | sum_len | none (pure TP, or no step)
    recorded: bool  # a compiled bucket fits the busiest rank
    bucket: int | None  # rows every rank is padded to (MAX_LEN / recorded attention)
    row_bytes: int
    gathered_rows: int  # rows in the gather buffer on each device
    exact_rows: int  # rows that exist (sum over ranks)
    padded_rows: int  # rows a padded buffer needs: (bucket or busiest rank) x dp
    lm_head_form: str  # gather | all_to_all | replicated | tp
    collectives: tuple[Collective, ...]
    attention_sglang: RowCount
    attention_jaxdp: RowCount  # one SPMD program: every rank runs the busiest rank's shape
    experts_sglang: RowCount
    experts_jaxdp: RowCount
    lm_head: RowCount

    @property
    def gathered_bytes(self) -> int:
        return self.gathered_rows * self.row_bytes

    @property
    def padded_bytes(self) -> int:
        return self.padded_rows * self.row_bytes

    @property
    def exact_bytes(self) -> int:
        return self.exact_rows * self.row_bytes

    @property
    def bytes_per_layer(self) -> int:
        """Bytes of the collectives that run once per layer (their largest count of layers)."""
        return sum(c.buffer_bytes for c in self.collectives if c.calls > 1)

    @property
    def bytes_per_step(self) -> int:
        return sum(c.bytes_per_step for c in self.collectives)

    @property
    def imbalance(self) -> float:
        """Busiest rank's rows over the mean (SGLang's dp_attention_token_imbalance_ratio)."""
        total = sum(self.rows)
        return max(self.rows) * len(self.rows) / total if total else 1.0

    def collective(self, name: str) -> Collective | None:
        return next((c for c in self.collectives if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["collectives"] = [{**dataclasses.asdict(c), "bytes_per_step": c.bytes_per_step}
                            for c in self.collectives]
        for key in ("attention_sglang", "attention_jaxdp", "experts_sglang", "experts_jaxdp", "lm_head"):
            d[key]["ratio"] = getattr(self, key).ratio
        d.update(gathered_bytes=self.gathered_bytes, padded_bytes=self.padded_bytes,
                 exact_bytes=self.exact_bytes, bytes_per_step=self.bytes_per_step,
                 bytes_per_layer=self.bytes_per_layer, imbalance=self.imbalance)
        return d

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a metrics exporter (one gauge each)."""
        m: dict[str, float] = {
            "rows_total": self.exact_rows, "rows_max": max(self.rows), "imbalance": self.imbalance,
            "gathered_rows": self.gathered_rows, "padded_rows": self.padded_rows,
            "gather_sum_len": float(self.gather_mode == SUM_LEN), "recorded": float(self.recorded),
            "bytes_per_step": self.bytes_per_step,
            "attention_ratio": self.attention_jaxdp.ratio,
            "attention_ratio_sglang": self.attention_sglang.ratio,
            "experts_ratio_sglang": self.experts_sglang.ratio,
            "experts_ratio": self.experts_jaxdp.ratio, "lm_head_ratio": self.lm_head.ratio,
        }
        for c in self.collectives:
            m[f"bytes_{c.name}"] = c.bytes_per_step
        return m


# ---- the accounting ----------------------------------------------------------------------------------

def _choose(rows: tuple[int, ...], kind: str, gather_mode: str, bucket: int | None,
            decode_max_bs: int, extend_max_tokens: int, relabel: bool) -> tuple[str, bool, int | None]:
    """(mode, recorded, bucket) following SGLang: a recorded step replays one shared MAX_LEN bucket
    sized by the busiest rank; an unrecorded step with a prompt uses the exact SUM_LEN buffer; an
    unrecorded decode step takes the cheaper of the two (all-gather of max*dp vs all-reduce of sum)."""
    busiest, total, dp = max(rows), sum(rows), len(rows)
    if bucket is None:
        table = decode_buckets(decode_max_bs) if kind == DECODE else extend_buckets(extend_max_tokens)
        bucket = bucket_for(busiest, table) if (kind == DECODE or relabel) else None
    elif bucket < busiest:
        raise ValueError(f"bucket {bucket} is smaller than the busiest rank's {busiest} rows")
    recorded = bucket is not None
    if gather_mode == "auto":
        if recorded:
            mode = MAX_LEN
        elif kind == EXTEND:
            mode = SUM_LEN
        else:
            mode = MAX_LEN if 2 * total > busiest * dp else SUM_LEN
    elif gather_mode in (MAX_LEN, SUM_LEN):
        mode = gather_mode
    else:
        raise ValueError(f"gather_mode must be auto, max_len or sum_len, not {gather_mode!r}")
    return mode, recorded, bucket


def account_step(
    layout: Layout,
    cfg: ModelConfig,
    rows_per_rank: tuple[int, ...] | list[int],
    *,
    gather_mode: str = "auto",
    bucket: int | None = None,
    act_bytes: int = 2,
    is_extend: bool | None = None,
    lm_rows: tuple[int, ...] | list[int] | None = None,
    lm_head_a2a: bool | None = None,
    logit_bytes: int | None = None,
    decode_max_bs: int = 512,
    extend_max_tokens: int = 2048,
) -> StepAccount:
    """Account one step. `rows_per_rank` has one entry per DP rank (layout.dp entries).

    is_extend: a prompt is read somewhere (None: a prompt when the busiest rank exceeds the largest
    decode bucket). bucket: the rows each rank is padded to, when the caller knows what it compiled.
    lm_rows: rows that need logits per rank (default: all rows). lm_head_a2a: use the all-to-all LM head
    when all ranks have equal rows, falling back to the gather otherwise (default: layout.lm_head_a2a).
    A prompt step under moe=ep is never recorded: SGLang refuses the relabeling with its EP backends.
    """
    if lm_head_a2a is None:
        lm_head_a2a = layout.lm_head_a2a
    rows = tuple(int(r) for r in rows_per_rank)
    if len(rows) != layout.dp or any(r < 0 for r in rows):
        raise ValueError(f"need {layout.dp} non-negative row counts (one per DP rank), got {rows}")
    lm = tuple(int(r) for r in (lm_rows if lm_rows is not None else rows))
    if len(lm) != layout.dp:
        raise ValueError(f"need {layout.dp} lm_rows, got {lm}")
    row_bytes = cfg.hidden_size * act_bytes
    logit_bytes = act_bytes if logit_bytes is None else logit_bytes
    dp, tp, world, L = layout.dp, layout.tp, layout.world, cfg.num_layers
    total, busiest = sum(rows), max(rows)
    if total == 0:  # every rank idle: no step runs at all
        zero = RowCount(0, 0)
        return StepAccount(rows, IDLE, NO_GATHER, False, None, row_bytes, 0, 0, 0, "none", (),
                           zero, zero, zero, zero, zero)
    if is_extend is None:
        is_extend = busiest > decode_buckets(decode_max_bs)[-1]
    kind = EXTEND if is_extend else DECODE
    mode, recorded, bucket = _choose(rows, kind, gather_mode, bucket, decode_max_bs, extend_max_tokens,
                                     relabel=layout.moe != "ep" or layout.dp == 1)
    per_rank = bucket if bucket is not None else busiest  # rows each rank's compiled step holds
    padded_rows = per_rank * dp
    gathered = padded_rows if mode == MAX_LEN else total
    gather_layers = 0 if dp == 1 else (
        (cfg.num_moe_layers if layout.moe == "tp" else 0)
        + (0 if layout.dense_replicated else cfg.num_dense_layers))
    # SGLang: with nothing tensor-parallel in a layer (tp=1, EP, dense replicated), each rank picks the
    # bucket for its own batch (Figure 12, third row); jaxdp runs one program, so one shape for all
    independent = dp > 1 and tp == 1 and gather_layers == 0
    if dp == 1 or independent:
        mode, gathered = NO_GATHER, (per_rank if dp == 1 else 0)
    cs: list[Collective] = []

    def add(name: str, op: str, group: int, nbytes: int, calls: int) -> None:
        if calls > 0 and group > 1 and nbytes > 0:
            cs.append(Collective(name, op, group, int(nbytes), calls))

    rank_buf = per_rank * row_bytes
    gbuf = gathered * row_bytes
    if dp == 1:  # tensor parallelism: two all-reduces per layer over all rows
        add("attn_allreduce", "all_reduce", tp, rank_buf, L)
        ep_layers = cfg.num_moe_layers if layout.moe == "ep" else 0
        add("mlp_allreduce", "all_reduce", tp, rank_buf, L - ep_layers)
    else:
        if mode == MAX_LEN:  # Figure 12: the group's all-reduce folded into the gather
            add("attn_group_scatter", "reduce_scatter", tp, rank_buf, gather_layers)
            add("attn_group_gather", "all_gather", tp, rank_buf, gather_layers)
            add("attn_allreduce", "all_reduce", tp, rank_buf, L - gather_layers)
            add("gather", "all_gather", world, gbuf, gather_layers)
            add("return", "reduce_scatter", world, gbuf, gather_layers)
        else:  # exact buffer: rows written at offsets into zeros, summed; partial sums summed, copied out
            add("attn_allreduce", "all_reduce", tp, rank_buf, L)
            add("gather", "all_reduce", world, gbuf, gather_layers)
            add("return", "all_reduce", world, gbuf, gather_layers)
    if layout.moe == "ep":  # whole experts per device: rows travel to their top-k experts and back
        dev_rows = math.ceil(busiest / tp) if dp > 1 else math.ceil(per_rank / tp)
        a2a = dev_rows * cfg.num_experts_per_tok * row_bytes
        add("dispatch", "all_to_all", world, a2a, cfg.num_moe_layers)
        add("combine", "all_to_all", world, a2a, cfg.num_moe_layers)

    # the LM head
    lm_total, vocab = sum(lm), cfg.vocab_size
    lm_busiest = max(lm)
    if dp == 1:
        form = "tp"
        add("logits", "all_gather", tp, lm_total * vocab * logit_bytes, 1)
        lm_count = RowCount(lm_total, lm_total)
    elif layout.dp_lm_head:
        form = "replicated"
        add("logits", "all_gather", tp, lm_busiest * vocab * logit_bytes, 1)
        lm_count = RowCount(lm_total, lm_total)
    elif lm_head_a2a and len(set(lm)) == 1:
        form = "all_to_all"
        add("lm_gather", "all_gather", world, lm_total * row_bytes, 1)
        add("logits", "all_to_all", world, lm_total * math.ceil(vocab / world) * logit_bytes, 1)
        lm_count = RowCount(lm_total, lm_total)
    else:
        form = "gather"
        add("lm_gather", "all_reduce", world, lm_total * row_bytes, 1)
        add("logits", "all_gather", world, lm_total * vocab * logit_bytes, 1)
        # every device ends with the logits of all rows; its group needs only its own
        lm_count = RowCount(world * lm_total, tp * lm_total)
    if dp > 1:
        add("agreement", "cpu_all_gather", dp, dp * AGREEMENT_INTS * 4, 1)

    if independent and recorded:
        table = decode_buckets(decode_max_bs) if kind == DECODE else extend_buckets(extend_max_tokens)
        attn_sglang = sum(bucket_for(r, table) or r for r in rows if r)
    else:
        attn_sglang = per_rank * dp if (recorded or dp == 1) else total
    # SGLang's TP MoE computes every row of its buffer, padding included; EP never dispatches padding
    experts_sglang = RowCount(total if layout.moe == "ep" else gathered, total)
    return StepAccount(
        rows=rows, kind=kind, gather_mode=mode, recorded=recorded, bucket=bucket, row_bytes=row_bytes,
        gathered_rows=gathered, exact_rows=total, padded_rows=padded_rows, lm_head_form=form,
        collectives=tuple(cs), attention_sglang=RowCount(attn_sglang, total),
        attention_jaxdp=RowCount(padded_rows, total), experts_sglang=experts_sglang,
        experts_jaxdp=RowCount(total, total), lm_head=lm_count,
    )


def account_situations(layout: Layout, cfg: ModelConfig, situations: dict[str, Situation] | None = None,
                       **kw: Any) -> dict[str, StepAccount]:
    """account_step for each situation (default: the article's five, for layout.dp ranks)."""
    situations = situations if situations is not None else five_situations(layout.dp)
    return {name: account_step(layout, cfg, s.rows, is_extend=s.kind == EXTEND, lm_rows=s.lm_rows, **kw)
            for name, s in situations.items()}
