"""The engine's options (what `python -m jaxdp.serve` flags set), in one dataclass."""

from __future__ import annotations

import dataclasses

from jaxdp.engine.delayer import DelayerConfig


@dataclasses.dataclass
class EngineConfig:
    page_size: int = 16
    num_pages: int = 256  # per DP rank
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
    enable_mixed_chunk: bool = False  # a prompt step carries the rank's own decoders (jaxdp/engine/mixed.py)
    prefill_delayer: DelayerConfig | None = None  # --enable-prefill-delayer (jaxdp/engine/delayer.py)
