"""The options of an engine and of the model it runs (what `python -m jaxdp.serve` flags set), each in one
dataclass: `ModelOptions` builds the weights and the step runner (`jaxdp.engine.setup.build_runners`),
`EngineConfig` the schedulers and the loop. The runner owns the KV pool's page size and page count; an
EngineConfig's `page_size` / `num_pages` say what to build it with (unset: 16 tokens, 256 pages), and an
engine given a ready runner reads them from it."""

from __future__ import annotations

import dataclasses

from jaxdp.engine.sched.delayer import DelayerConfig
from jaxdp.eplb.distribution import EplbConfig

DEFAULT_PAGE_SIZE, DEFAULT_NUM_PAGES = 16, 256


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    path: str | None = "default"  # a checkpoint directory, "default" (the embedded model) or a preset
    dtype: str = "float32"  # or "auto": bfloat16 on a GPU, float32 on a CPU (decided where the model is built)
    seed: int = 0  # a preset's random weights
    quantization: str | None = None  # "nvfp4" | "fp8" (a quantized checkpoint says so itself)
    attention_backend: str | None = None  # MLA decode: one of jaxdp.ops.registry.ATTENTION_BACKENDS (None: the default)
    moe_backend: str | None = None  # one of jaxdp.ops.registry.MOE_RUNNER_BACKENDS (None: the platform's default)
    index_key_dtype: str | None = None  # DSA models: None (the cache's dtype) or "fp8"
    num_layers: int | None = None  # fewer layers than the checkpoint's (experiments)
    tiny_width: bool = False  # the model's layers at a tiny width (experiments)
    draft: bool = False  # also build the checkpoint's MTP layer (speculative decoding's draft model)
    fp8_gemm_backend: str | None = None  # the projection GEMM: one of jaxdp.ops.registry.FP8_GEMM_BACKENDS
    ep_num_redundant_experts: int = 0  # moe=ep: R redundant expert slots (jaxdp.eplb.slots)
    init_expert_location: str | None = None  # a placement or recorded load file (jaxdp.eplb.placement)
    ep_dispatch_algorithm: str = "static"  # or "dynamic": how a pair picks one of its expert's replicas (jaxdp.eplb)
    deterministic: bool = False  # --enable-deterministic-inference: batch-invariant kernels (docs/determinism.md)
    dcp_size: int = 1  # --dcp-size: the KV pool split token-wise over the group's tp devices (docs/dcp.md)


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (SGLang's --disaggregation-* flags; `jaxdp.disagg`)."""

    mode: str  # "prefill": read prompts and hand their KV over; "decode": take it and decode
    bootstrap_port: int = 8998  # the prefill server's bootstrap endpoint
    backend: str = "jax"  # the KV transfer library (jaxdp.disagg.transfer.TRANSPORTS)
    host: str = "127.0.0.1"  # where this server's transfer server and bootstrap endpoint listen
    timeout_s: float = 60.0  # the longest a decode server waits for a request's KV; a prefill server keeps it
    model: str = ""  # the model's fingerprint both servers must share (jaxdp.disagg.handoff.model_fingerprint)


SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")  # SGLang's names for a draft model; both mean the MTP layer here


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with the model's MTP layer (SGLang's --speculative-* flags; `jaxdp.engine.step.spec`)."""

    algorithm: str = "EAGLE"  # EAGLE | NEXTN: the checkpoint's MTP layer drafts (SGLang treats NEXTN as EAGLE)
    num_steps: int = 3  # draft steps a verify checks (SGLang's DeepSeek default)
    eagle_topk: int = 1  # one chain (trees are not built)
    num_draft_tokens: int = 4  # rows a verify reads per request: num_steps + 1 with a chain
    disable_by_batch_size: int | None = None  # vLLM's: no speculation while more requests are held

    def __post_init__(self):
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm {self.algorithm!r} is not one of "
                             f"{', '.join(SPECULATIVE_ALGORITHMS)} (the model's MTP layer drafts)")
        if self.num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be at least 1, got {self.num_steps}")
        if self.eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk {self.eagle_topk}: only a chain (topk 1) is built; use "
                             "--speculative-eagle-topk 1")
        if self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"--speculative-num-draft-tokens {self.num_draft_tokens} does not match "
                             f"--speculative-num-steps {self.num_steps} with topk 1; use "
                             f"--speculative-num-draft-tokens {self.num_steps + 1}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"--speculative-disable-by-batch-size must be at least 1, got "
                             f"{self.disable_by_batch_size}; leave it out to speculate at every batch size")


@dataclasses.dataclass
class EngineConfig:
    page_size: int | None = None  # tokens per KV page (None: a ready runner's, or 16)
    num_pages: int | None = None  # per DP rank (None: a ready runner's, or 256)
    max_running_requests: int = 64  # all ranks together (divided among them)
    chunked_prefill_size: int = 256  # all ranks together (divided among them under attention DP)
    context_length: int | None = None  # default: min(max_position_embeddings, pool size)
    schedule_conservativeness: float = 1.0
    decode_buckets: list[int] | None = None  # default: SGLang's list up to the per-rank batch
    extend_buckets: list[int] | None = None  # default: powers of two up to the per-rank chunk
    max_len_extend_rows: int = 256  # extend steps up to this many rows per rank pad (MAX_LEN); beyond: SUM_LEN
    disable_cuda_graph: bool = False  # compile steps on first use instead of at start-up
    load_balance_method: str = "round_robin"
    enable_prefix_cache: bool = True
    seed: int = 0
    overlap: bool = True  # plan and queue step N+1 before reading step N's tokens back
    enable_mixed_chunk: bool = False  # a prompt step carries the rank's own decoders (jaxdp/engine/sched/mixed.py)
    prefill_delayer: DelayerConfig | None = None  # --enable-prefill-delayer (jaxdp/engine/sched/delayer.py)
    disaggregation: DisaggConfig | None = None  # --disaggregation-mode prefill|decode (jaxdp/engine/step/pd_sides.py)
    speculative: SpeculativeConfig | None = None  # --speculative-algorithm (jaxdp/engine/step/spec.py)
    eplb: EplbConfig | None = None  # --enable-eplb: online expert rebalancing (jaxdp/eplb/online.py)
    grammar_backend: str = "none"  # --grammar-backend: the grammar library of structured outputs (jaxdp/grammar)
    tbo_threshold: float | None = None  # --enable-two-batch-overlap's --tbo-token-distribution-threshold (docs/tbo.md)

    @property
    def pool_page_size(self) -> int:
        """The page size to build a runner with."""
        return DEFAULT_PAGE_SIZE if self.page_size is None else self.page_size

    @property
    def pool_pages(self) -> int:
        """The pages per rank to build a runner with."""
        return DEFAULT_NUM_PAGES if self.num_pages is None else self.num_pages

    def check_runner(self, runner) -> None:
        """A ready runner's pool must be the one this config asks for, where it asks (the slots the host
        computes would land in the wrong places)."""
        for name in ("page_size", "num_pages"):
            if (mine := getattr(self, name)) is not None and mine != getattr(runner, name):
                raise ValueError(f"{name} {mine} differs from the step runner's {getattr(runner, name)}; leave it "
                                 "unset to use the runner's")
