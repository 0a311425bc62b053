"""SGLang's metric names (`sglang:`, as `--enable-metrics` exports them) beside jaxdp's own, so that a dashboard
or an alert built for SGLang works unchanged: labels `model_name` and `dp_rank`, SGLang's histogram buckets.

Gauges (read from the ranks' state when Prometheus scrapes, the same read as jaxdp's): num_running_reqs,
num_queue_reqs, num_used_tokens, token_usage, gen_throughput, cache_hit_rate. Counters: prompt_tokens_total,
generation_tokens_total, num_requests_total, cached_tokens_total. Histograms: time_to_first_token_seconds,
inter_token_latency_seconds, e2e_request_latency_seconds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from jaxdp.disagg.kv_stats import metric_families as kv_metric_families
from jaxdp.engine import Request

S = "sglang:"
LABELS = ["model_name", "dp_rank"]
# SGLang's buckets (python/sglang/srt/metrics/collector.py)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
               0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
GAUGES = {  # SGLang's name: (the rank state's key, help)
    "num_running_reqs": ("num_running_reqs", "The number of running requests"),
    "num_queue_reqs": ("num_queue_reqs", "The number of requests in the waiting queue"),
    "num_used_tokens": ("num_used_tokens", "The number of used tokens"),
    "token_usage": ("token_usage", "The token usage"),
    "cache_hit_rate": ("cache_hit_rate", "The prefix cache hit rate"),
}


class SglangMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        r = registry
        self.prompt_tokens = Counter(S + "prompt_tokens", "Number of prefill tokens processed", LABELS, registry=r)
        self.generation_tokens = Counter(S + "generation_tokens", "Number of generation tokens processed", LABELS,
                                         registry=r)
        self.cached_tokens = Counter(S + "cached_tokens", "Number of cached prompt tokens", LABELS, registry=r)
        self.num_requests = Counter(S + "num_requests", "Number of requests processed", LABELS, registry=r)
        self.ttft = Histogram(S + "time_to_first_token_seconds", "Histogram of time to first token in seconds",
                              LABELS, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(S + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds",
                             LABELS, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(S + "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             LABELS, buckets=E2E_BUCKETS, registry=r)
        self._per_token: dict[int, tuple] = {}

    def observe_tokens(self, rank: int, gap: float, new: int, first: bool) -> None:
        if (children := self._per_token.get(rank)) is None:
            labels = (self.model_name, str(rank))
            children = self._per_token[rank] = (self.generation_tokens.labels(*labels), self.itl.labels(*labels))
        children[0].inc(new)
        if not first:
            children[1].observe(gap / new)

    def observe_finish(self, rank: int, req: Request) -> None:
        if not req.finished or req.finish_reason == "abort":
            return
        labels = (self.model_name, str(rank))
        self.num_requests.labels(*labels).inc()
        self.prompt_tokens.labels(*labels).inc(len(req.prompt_ids))
        self.cached_tokens.labels(*labels).inc(req.cached_tokens)
        if req.first_token_at is not None:
            self.ttft.labels(*labels).observe(req.first_token_at - req.created)
        if req.finished_at is not None:
            self.e2e.labels(*labels).observe(req.finished_at - req.created)

    def gauges(self, states: list[dict], gen_throughput: list[float]):
        """SGLang's gauges from the ranks' states (the read jaxdp's gauges use too)."""
        for name, (key, doc) in GAUGES.items():
            g = GaugeMetricFamily(S + name, doc, labels=LABELS)
            for s in states:
                g.add_metric([self.model_name, str(s["dp_rank"])], float(s[key]))
            yield g
        g = GaugeMetricFamily(S + "gen_throughput", "The generation throughput (token/s)", labels=LABELS)
        for rank, value in enumerate(gen_throughput):
            g.add_metric([self.model_name, str(rank)], value)
        yield g
        for name, doc in (("spec_accept_length", "The average acceptance length of speculative decoding"),
                          ("spec_accept_rate", "The average acceptance rate of speculative decoding")):
            if any(name in s for s in states):  # a server that speculates
                g = GaugeMetricFamily(S + name, doc, labels=LABELS)
                for s in states:
                    g.add_metric([self.model_name, str(s["dp_rank"])], float(s.get(name, 0.0)))
                yield g
        # prefill/decode disaggregation: its queues, transfers and failures (jaxdp.disagg.kv_stats)
        yield from kv_metric_families(S, states, LABELS, lambda s: [self.model_name, str(s["dp_rank"])])
