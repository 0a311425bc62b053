"""A roofline estimate of one decode step, for the busiest device of a layout.

Each term is max(bytes read from HBM / HBM bandwidth, FLOPs / peak bf16 FLOP/s); the collectives cost
(bytes one device sends / link bandwidth + a fixed latency) per call; terms add up (no overlap). It is a
floor, not a prediction: kernels run below peak, and launch and host overheads are not in it. Its use is
to say where the time goes and how two layouts differ.

Assumptions (printed by the planner): a decode row is one request with `context` tokens of cache; DSA
main attention reads min(context, index_topk) latents, its indexer reads all `context` index keys; the
routed experts a step reads are those its rows pick, expected under uniform independent routing
(E * (1 - (1 - k/E)^rows)); SGLang routes padding rows like real rows, jaxdp masks them; under TP every
device reads the latent cache of every request (MLA has one KV head), under attention DP only its own.

The same model prices a step on any device that says its read bandwidth, dot throughput and link
(`hbm_bytes_per_s`, `flops_per_s`, `link_bytes_per_s`): a GPU preset for the planner, or this machine as
`jaxdp.bench.roofline` measures it, for the benchmarks' "N x the floor". An extend step is rows of
`tokens_per_row` new tokens each, each reading `context` cached tokens plus its own (causally, half of
them on average); `weight_dtype="fp32"` prices weights held in float32 (a CPU that computes in float32).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxdp.parallel.accounting import account_step
from jaxdp.planner.weights import kv_bytes, weights_per_device

if TYPE_CHECKING:
    from jaxdp.config import ModelConfig
    from jaxdp.layout import Layout
    from jaxdp.planner.gpus import GPU

# The article's measurements (GLM-5.3 NVFP4, 4 x B300, no speculative decoding), ms per output token.
ARTICLE_MS = {
    ("tp", "single"): 6.6,
    ("dp", "single"): 12.2,
    ("dp", "balanced"): 24.9,  # 16 requests per GPU, 1,024 tokens of context
    ("dp", "skewed"): 29.0,
}
ARTICLE_NON_EXPERT_GEMM_EXTRA_MS = 3.3  # DP minus TP, kernel trace of one request (section 7)
ARTICLE_EXPERT_GEMM_EXTRA_MS = 1.1  # "about 1.1 ms" (1.3 -> 2.5 ms): the padding rows of the gather


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    hbm_bytes: float
    flops: float
    seconds: float

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


@dataclasses.dataclass(frozen=True)
class Roofline:
    layout: str
    rows: tuple[int, ...]
    context: int
    terms: tuple[Term, ...]

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.terms)

    @property
    def ms(self) -> float:
        return self.seconds * 1e3

    def term(self, name: str) -> Term:
        return next((t for t in self.terms if t.name == name), Term(name, 0.0, 0.0, 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "rows": list(self.rows), "context": self.context, "ms": self.ms,
                "terms": [{**dataclasses.asdict(t), "ms": t.ms} for t in self.terms]}


def expected_experts(rows: int, n_experts: int, top_k: int) -> float:
    """Distinct experts `rows` rows pick under uniform independent routing."""
    if rows <= 0:
        return 0.0
    return n_experts * (1 - (1 - top_k / n_experts) ** rows)


def decode_roofline(cfg: ModelConfig, layout: Layout, gpu: GPU, rows: tuple[int, ...], *,
                    context: int = 1024, expert_dtype: str = "bf16", kv_dtype: str = "bf16",
                    absorbed_copy: bool | None = None, placement: str = "sglang", latency_us: float = 10.0,
                    padding: str = "sglang", tokens_per_row: int = 1, weight_dtype: str = "bf16",
                    num_redundant_experts: int = 0, balancedness: float = 1.0) -> Roofline:
    """One decode step on the busiest device; `padding` is "sglang" (padding rows reach the experts)
    or "jaxdp" (the router masks them). `tokens_per_row` > 1: an extend step (rows are sequences);
    `weight_dtype` "fp32": the weights held in float32 (twice the bytes of bf16, experts included).
    Under moe=ep the routed experts are priced on the most loaded device: with `balancedness` b (mean / max
    (row, choice) pairs a device, 1.0 even) it computes 1 / b times the mean device's pairs and reads the slots
    they touch among its (E + R) / N (`num_redundant_experts` R); under moe=tp every device computes a slice of
    every pair, so b does not change the step."""
    if weight_dtype not in ("bf16", "fp32"):
        raise ValueError(f"weight dtype {weight_dtype!r} is unknown; use bf16 or fp32")
    if not 0 < balancedness <= 1:
        raise ValueError(f"balancedness {balancedness} is mean / max tokens a device; give a value in (0, 1]")
    held = 2.0 if weight_dtype == "fp32" else 1.0  # bytes relative to the bf16 / expert_dtype figures
    t = tokens_per_row
    acct = account_step(layout, cfg, [r * t for r in rows], is_extend=t > 1)
    comps = {c.name: c for c in weights_per_device(cfg, layout, expert_dtype, absorbed_copy, placement,
                                                   num_redundant_experts=num_redundant_experts)}
    bw, peak, link = gpu.hbm_bytes_per_s, gpu.flops_per_s, gpu.link_bytes_per_s
    n, tp = layout.world, layout.tp
    L, Lm, h, k = cfg.num_layers, cfg.num_moe_layers, cfg.hidden_size, cfg.num_experts_per_tok
    att_rows = acct.bucket or max(rows) * t  # rows this device's attention runs (padded to the bucket)
    requests = sum(rows) if layout.dp == 1 else max(rows)  # caches this device reads
    moe_rows = acct.experts_sglang.computed if padding == "sglang" else acct.exact_rows
    if layout.moe == "ep":
        moe_rows = acct.exact_rows
    terms: list[Term] = []

    def add(name: str, nbytes: float, flops: float) -> None:
        terms.append(Term(name, nbytes, flops, max(nbytes / bw, flops / peak)))

    def weights(name: str, rows_: int) -> None:
        c = comps.get(name)
        if c is not None:
            scale = 1.0 if name == "router" else held  # jaxdp's router is float32 already
            add(name, c.bytes_per_device * scale, 2 * c.params * (c.bytes_per_device / c.bytes_total) * rows_)

    weights("attention projections", att_rows)
    weights("DSA indexer", att_rows)
    kvb = kv_bytes(cfg, kv_dtype)
    cached = context + t  # what a row's sequence holds after the step
    attended = min(cached, cfg.index_topk) if cfg.index_topk else cached
    kv_read = requests * L * (kvb.latent * attended + kvb.indexer * cached) * (2 if held > 1 else 1)
    heads = cfg.num_heads / tp
    per_token = context + (t + 1) / 2  # keys a new token attends to, on average (causal within the row)
    attended_t = min(per_token, cfg.index_topk) if cfg.index_topk else per_token
    kv_flops = requests * t * L * 2 * (heads * (cfg.kv_cache_dim + cfg.kv_lora_rank) * attended_t
                                       + cfg.index_n_heads * cfg.index_head_dim * per_token)
    add("KV cache", kv_read, kv_flops)
    weights("router", moe_rows)
    experts = comps.get("routed experts")  # none where every layer is dense (a preset cut to its first layers)
    if experts is not None and layout.moe == "ep":  # the most loaded device: 1 / balancedness of the mean's pairs
        E, hot_rows = cfg.n_routed_experts, moe_rows / balancedness
        slots = (E + num_redundant_experts) // n
        touched = 1 - (1 - k / E) ** hot_rows  # each of its slots, as one logical expert of hot_rows rows
        add("routed experts", experts.bytes_total / E * slots * touched * held,
            2 * 3 * h * cfg.moe_intermediate_size * Lm * hot_rows * k / n)
    elif experts is not None:
        touched = expected_experts(moe_rows, cfg.n_routed_experts, k) / cfg.n_routed_experts
        add("routed experts", experts.bytes_total * touched / n * held,
            2 * 3 * h * cfg.moe_intermediate_size * Lm * moe_rows * k / n)
    weights("shared expert", moe_rows)
    weights("dense layers", acct.gathered_rows)
    lm_rows = max(rows) if layout.dp_lm_head else sum(rows)  # one logits row per sequence
    weights("LM head", lm_rows)
    weights("norms", att_rows)
    coll_bytes = sum(c.wire_bytes * c.calls for c in acct.collectives if c.op != "cpu_all_gather")
    calls = sum(c.calls for c in acct.collectives if c.op != "cpu_all_gather")
    terms.append(Term("collectives", 0.0, 0.0, coll_bytes / link + calls * latency_us * 1e-6))
    label = f"dp={layout.dp},tp={layout.tp},moe={layout.moe}"
    return Roofline(label, tuple(rows), context, tuple(terms))

