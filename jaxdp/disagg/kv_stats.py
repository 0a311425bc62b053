"""The hand-off's figures per rank, and their Prometheus families under SGLang's names.

Each rank of a server in a disaggregation mode keeps a `RankKV` (plain numbers, so that they travel with the
rank's state from an engine process or another node, like the scheduler's own figures); `/metrics` turns them
into SGLang's metrics (`python/sglang/srt/observability/metrics_collector.py`, its "PD disaggregation" block),
under `sglang:` with SGLang's labels and buckets and under `jaxdp:` with `dp_rank`:

- queues: `num_prefill_inflight_queue_reqs` (prefill: KV offered, not yet taken by a decode server, not yet
  dropped), `num_decode_prealloc_queue_reqs` (decode: waiting for pages), `num_decode_transfer_queue_reqs`
  (decode: pages given, KV on its way). jaxdp's prefill server reads a prompt as soon as it comes, so SGLang's
  `num_prefill_bootstrap_queue_reqs` has nothing to count and is not exported.
- per transfer, on the decode side, where the pull is timed: `kv_transfer_latency_ms` (the pull, from asking
  for the arrays to the last byte), `kv_transfer_speed_gb_s` (bytes over that), `kv_transfer_total_mb`,
  `kv_transfer_bootstrap_ms` (from asking the prefill server's bootstrap endpoint to the room being ready:
  the prompt's reading, as the decode side waits for it); histograms with SGLang's buckets.
- `num_bootstrap_failed_reqs_total` (the room refused, never ready, another model, the prefill server gone
  before the pull) and `num_transfer_failed_reqs_total` (the pull failed).
- jaxdp's own: `kv_transfer_bytes_total` and `kv_transfer_seconds_total` (decode: received, pulling;
  prefill: offered, offering with the pages' read dispatched), `kv_transfers_total` (decode: pulled;
  prefill: offered), `kv_offers_dropped_total` (prefill: offers no decode server took within
  `--disaggregation-timeout`).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# SGLang's buckets (metrics_collector.py, PD disaggregation)
SPEED_GBS_BUCKETS = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)
LATENCY_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
BOOTSTRAP_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
TOTAL_MB_BUCKETS = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)


@dataclasses.dataclass
class Hist:
    """A histogram as plain numbers: counts per bucket (the last: past every bound) and the sum."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def to_json(self) -> dict:
        return {"counts": list(self.counts), "sum": self.total}


@dataclasses.dataclass
class RankKV:
    """One rank's hand-offs (counters only grow; the queues are read from the scheduler when asked)."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bootstrap_failed: int = 0
    transfer_failed: int = 0
    latency_ms: Hist = dataclasses.field(default_factory=lambda: Hist(LATENCY_MS_BUCKETS))
    speed_gbs: Hist = dataclasses.field(default_factory=lambda: Hist(SPEED_GBS_BUCKETS))
    total_mb: Hist = dataclasses.field(default_factory=lambda: Hist(TOTAL_MB_BUCKETS))
    bootstrap_ms: Hist = dataclasses.field(default_factory=lambda: Hist(BOOTSTRAP_MS_BUCKETS))

    def pulled(self, nbytes: int, pull_s: float, bootstrap_s: float) -> None:
        self.transfers += 1
        self.bytes += nbytes
        self.seconds += pull_s
        self.latency_ms.observe(pull_s * 1e3)
        self.speed_gbs.observe(nbytes / max(pull_s, 1e-9) / 1e9)
        self.total_mb.observe(nbytes / 1e6)
        self.bootstrap_ms.observe(bootstrap_s * 1e3)

    def offered(self, nbytes: int, read_s: float) -> None:
        self.transfers += 1
        self.bytes += nbytes
        self.seconds += read_s

    def state(self, mode: str, **queues: int) -> dict:
        out = {"mode": mode, "transfers": self.transfers, "bytes": self.bytes, "seconds": self.seconds,
               "bootstrap_failed": self.bootstrap_failed, "transfer_failed": self.transfer_failed, **queues}
        if mode == "decode":
            out.update(latency_ms=self.latency_ms.to_json(), speed_gbs=self.speed_gbs.to_json(),
                       total_mb=self.total_mb.to_json(), bootstrap_ms=self.bootstrap_ms.to_json())
        return out


QUEUES = {  # SGLang's gauge: (the mode that has it, the rank state's key, help)
    "num_prefill_inflight_queue_reqs": ("prefill", "inflight", "The number of requests in the prefill inflight "
                                        "queue (KV offered, not yet taken by a decode server)."),
    "num_decode_prealloc_queue_reqs": ("decode", "prealloc", "The number of requests in the decode prealloc queue "
                                       "(waiting for pages)."),
    "num_decode_transfer_queue_reqs": ("decode", "transfer", "The number of requests in the decode transfer queue "
                                       "(pages given, KV on its way)."),
}
HISTOGRAMS = {  # SGLang's histogram: (the rank state's key, its bounds, help)
    "kv_transfer_speed_gb_s": ("speed_gbs", SPEED_GBS_BUCKETS, "Histogram of KV cache transfer speed in GB/s."),
    "kv_transfer_latency_ms": ("latency_ms", LATENCY_MS_BUCKETS, "Histogram of KV cache transfer latency in ms."),
    "kv_transfer_bootstrap_ms": ("bootstrap_ms", BOOTSTRAP_MS_BUCKETS,
                                 "Histogram of KV transfer bootstrap time in ms."),
    "kv_transfer_total_mb": ("total_mb", TOTAL_MB_BUCKETS, "Histogram of KV cache transfer size in MB."),
}


def metric_families(prefix: str, states: list[dict], labels: list[str], values) -> Iterator:
    """The hand-off's families under `prefix` for the ranks whose state has one (`values(state)`: the
    label values of a rank); nothing for a server not in a disaggregation mode."""
    ranks = [(s["disagg"], values(s)) for s in states if "disagg" in s]
    if not ranks:
        return
    for name, (mode, key, doc) in QUEUES.items():
        g = GaugeMetricFamily(prefix + name, doc, labels=labels)
        for d, lv in ranks:
            if d["mode"] == mode:
                g.add_metric(lv, float(d.get(key, 0)))
        yield g
    for name, (key, bounds, doc) in HISTOGRAMS.items():
        h = HistogramMetricFamily(prefix + name, doc, labels=labels)
        for d, lv in ranks:
            if key in d:
                counts, cum = d[key]["counts"], []
                for c in counts:
                    cum.append((cum[-1] if cum else 0) + c)
                buckets = [(str(float(b)), cum[i]) for i, b in enumerate(bounds)] + [("+Inf", cum[-1])]
                h.add_metric(lv, buckets, d[key]["sum"])
        yield h
    counters = {
        "num_bootstrap_failed_reqs": ("bootstrap_failed", "The number of bootstrap failed requests."),
        "num_transfer_failed_reqs": ("transfer_failed", "The number of transfer failed requests."),
        "kv_transfer_bytes": ("bytes", "KV bytes handed over (decode: received; prefill: offered)."),
        "kv_transfer_seconds": ("seconds", "Seconds spent on hand-offs (decode: pulling; prefill: offering, "
                                "the pages' read dispatched)."),
        "kv_transfers": ("transfers", "Requests' KV handed over (decode: pulled; prefill: offered)."),
        "kv_offers_dropped": ("dropped", "Prefill: KV offers no decode server took in time, dropped."),
    }
    for name, (key, doc) in counters.items():
        c = CounterMetricFamily(prefix + name, doc, labels=labels)
        for d, lv in ranks:
            if key in d:
                c.add_metric(lv, float(d[key]))
        yield c
