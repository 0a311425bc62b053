"""`/metrics` (prometheus-client): SGLang's metric names under a `jaxdp:` prefix, labelled by `dp_rank`, and the
same under SGLang's own `sglang:` prefix with its labels and buckets (`jaxdp.api.sglang_metrics`).

Three sources: the ranks' state, read when Prometheus scrapes (running / queued requests, tokens held,
token usage, prefix-cache hit rate, generation throughput); the requests, observed by the API layer as
they stream (token counters, TTFT, inter-token latency, end-to-end latency); the engine loop's step
records, read by the monitor (`jaxdp.api.monitor`) after each step: rows per rank, gather mode, padding
ratio, `dp_attention_token_imbalance_ratio`, idle ranks, host and device-wait time per step. Plus the
XLA compile counter (`jaxdp:compiles_total`), which stays flat after warm-up.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxdp.api.sglang_metrics import SglangMetrics
from jaxdp.disagg.kv_stats import metric_families as kv_metric_families
from jaxdp.engine import Request
from jaxdp.engine.sched.delayer import OUTCOMES
from jaxdp.engine.step.step_stats import StepRecord, compiles_total

P = "jaxdp:"
RANK = ["dp_rank"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 15, 20,
                25, 30, 60, 120, 300)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 4, 5, 6, 8, 10, 20, 40, 60, 80, 100, 150, 200, 300, 600, 1200)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
AGREE_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
RATIO_BUCKETS = (1, 1.1, 1.25, 1.5, 2, 3, 4, 6, 8, 16, 32)


class ServerMetrics:
    def __init__(self, backend, model_name: str = "default"):
        self.backend = backend
        self.registry = r = CollectorRegistry()
        self.sglang = SglangMetrics(r, model_name)  # SGLang's names beside these (jaxdp.api.sglang_metrics)
        self.gen_throughput = [0.0] * backend.num_ranks  # set by the monitor
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", RANK, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", RANK, registry=r)
        self.cached_tokens = Counter(P + "cached_tokens", "Prompt tokens reused from the prefix cache", RANK,
                                     registry=r)
        self.num_requests = Counter(P + "num_requests", "Finished requests", RANK, registry=r)
        self.num_aborted = Counter(P + "num_aborted_requests", "Requests aborted (client gone or refused)", RANK,
                                   registry=r)
        self.http_errors = Counter(P + "http_errors", "Answers with an error status (refused requests, limits, "
                                   "shutdown), by status", ["status"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", RANK,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between streamed tokens", RANK,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency", RANK,
                             buckets=E2E_BUCKETS, registry=r)
        # per step (attention DP)
        self.steps = Counter(P + "steps", "Engine steps run", ["replica", "kind", "gather_mode"], registry=r)
        self.rows = Gauge(P + "dp_attention_rows", "Rows (tokens) of the last step, per rank", RANK, registry=r)
        self.rows_total = Counter(P + "step_rows", "Rows (tokens) computed for requests, per rank", RANK,
                                  registry=r)
        self.gather = Gauge(P + "gather_mode", "1 for the gather mode of the last step", ["replica", "mode"],
                            registry=r)
        self.padding = Gauge(P + "padding_ratio", "Rows computed by attention over rows needed, last step",
                             ["replica"], registry=r)
        self.imbalance = Gauge(P + "dp_attention_token_imbalance_ratio",
                               "Busiest rank's tokens over the average, last step", ["replica"], registry=r)
        self.idle = Gauge(P + "dp_attention_idle_ranks", "Ranks that ran an idle batch in the last step",
                          ["replica"], registry=r)
        self.padding_hist = Histogram(P + "step_padding_ratio", "Padding ratio per step", ["replica"],
                                      buckets=RATIO_BUCKETS, registry=r)
        self.imbalance_hist = Histogram(P + "step_token_imbalance_ratio", "Token imbalance per step", ["replica"],
                                        buckets=RATIO_BUCKETS, registry=r)
        self.host_s = Histogram(P + "step_host_seconds", "Host time per step: scheduling, agreement, batch build",
                                ["replica"], buckets=STEP_BUCKETS, registry=r)
        self.wait_s = Histogram(P + "step_device_wait_seconds", "Time the loop waits for a step's tokens (the "
                                "slowest rank and the collectives)", ["replica"], buckets=STEP_BUCKETS, registry=r)
        self.agree_s = Histogram(P + "step_agreement_seconds", "Time in the per-step agreement (across nodes: the "
                                 "exchange through the distributed runtime)", ["replica"], buckets=AGREE_BUCKETS,
                                 registry=r)
        r.register(_StateCollector(self))
        self._per_token: dict[int, tuple] = {}
        backend.on_token.extend([self.observe_tokens, self.sglang.observe_tokens])
        backend.on_finish.extend([self.observe_finish, self.sglang.observe_finish])

    def observe_tokens(self, rank: int, gap: float, new: int, first: bool) -> None:
        """Every streamed token (the event loop's hot path: the rank's two children are looked up once)."""
        if (children := self._per_token.get(rank)) is None:
            label = str(rank)
            children = self._per_token[rank] = (self.generation_tokens.labels(label), self.itl.labels(label))
        children[0].inc(new)
        if not first:  # the first token's wait is TTFT, observed at the end
            children[1].observe(gap / new)

    def observe_finish(self, rank: int, req: Request) -> None:
        label = str(rank)
        if not req.finished or req.finish_reason == "abort":
            self.num_aborted.labels(label).inc()
            return
        self.num_requests.labels(label).inc()
        self.prompt_tokens.labels(label).inc(len(req.prompt_ids))
        self.cached_tokens.labels(label).inc(req.cached_tokens)
        if req.first_token_at is not None:
            self.ttft.labels(label).observe(req.first_token_at - req.created)
        if req.finished_at is not None:
            self.e2e.labels(label).observe(req.finished_at - req.created)

    def observe_step(self, replica: int, first_rank: int, rec: StepRecord) -> None:
        rl = str(replica)
        self.steps.labels(rl, rec.kind, rec.gather_mode).inc()
        for j, rows in enumerate(rec.rows):
            self.rows.labels(str(first_rank + j)).set(rows)
            self.rows_total.labels(str(first_rank + j)).inc(rows)
        for mode in ("max_len", "sum_len"):
            self.gather.labels(rl, mode).set(float(rec.gather_mode == mode))
        self.padding.labels(rl).set(rec.padding_ratio)
        self.imbalance.labels(rl).set(rec.imbalance)
        self.idle.labels(rl).set(rec.idle_ranks)
        self.padding_hist.labels(rl).observe(rec.padding_ratio)
        self.imbalance_hist.labels(rl).observe(rec.imbalance)
        self.host_s.labels(rl).observe(rec.host_s)
        self.wait_s.labels(rl).observe(rec.wait_s)
        self.agree_s.labels(rl).observe(rec.agree_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Per-rank gauges read from the schedulers when Prometheus scrapes."""

    GAUGES = {
        "num_running_reqs": "Requests running (decoding or reading their prompt)",
        "num_queue_reqs": "Requests waiting in the rank's queue",
        "num_used_tokens": "KV pool tokens in use (requests and prefix cache)",
        "token_usage": "Share of the KV pool held by requests",
        "max_total_num_tokens": "Tokens the rank's KV pool holds",
        "cache_hit_rate": "Prompt tokens reused from the prefix cache over prompt tokens looked up",
    }
    SPEC_GAUGES = {  # speculative decoding (SGLang's names), on ranks that verify
        "spec_accept_length": "Tokens a request gets per verify step (accepted drafts + 1), mean",
        "spec_accept_rate": "Draft tokens accepted over draft tokens offered",
    }

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def collect(self):
        backend = self.m.backend
        states = backend.states()
        for name, doc in self.GAUGES.items():
            g = GaugeMetricFamily(P + name, doc, labels=RANK)
            for s in states:
                g.add_metric([str(s["dp_rank"])], float(s[name]))
            yield g
        for name, doc in self.SPEC_GAUGES.items():
            if any(name in s for s in states):
                g = GaugeMetricFamily(P + name, doc, labels=RANK)
                for s in states:
                    g.add_metric([str(s["dp_rank"])], float(s.get(name, 0.0)))
                yield g
        g = GaugeMetricFamily(P + "gen_throughput", "Generation throughput (token/s)", labels=RANK)
        for rank, value in enumerate(self.m.gen_throughput):
            g.add_metric([str(rank)], value)
        yield g
        yield from self.m.sglang.gauges(states, self.m.gen_throughput)
        # with --engine-process the child counts its own
        compiles = max([compiles_total()] + [e.compiles for e in backend.engines])
        yield CounterMetricFamily(P + "compiles", "XLA compilations in the engines' process", value=compiles)
        c = CounterMetricFamily(P + "compiles_in_steps", "Compilations inside serving steps (after warm-up: a "
                                "missing bucket)", labels=["replica"])
        for i, e in enumerate(backend.engines):
            c.add_metric([str(i)], e.stats.compiles_in_steps)
        yield c
        yield from _delayer_metrics(backend.engines)
        yield from kv_metric_families(P, states, RANK, lambda s: [str(s["dp_rank"])])  # disaggregation's hand-off


def _delayer_metrics(engines):
    """--enable-prefill-delayer: the passes a prompt was held back, and how each pass with a prompt ended."""
    waits = CounterMetricFamily(P + "prefill_delayer_wait_passes", "Passes in which the prefill delayer held "
                                "new prompts back", labels=["replica"])
    outcomes = CounterMetricFamily(P + "prefill_delayer_outcomes", "Passes with a prompt on some rank, by the "
                                   "prefill delayer's decision", labels=["replica", "kind"])
    for i, e in enumerate(engines):
        if (d := e.delayer) is not None:
            waits.add_metric([str(i)], d.wait_passes)
            for kind in OUTCOMES[1:]:
                outcomes.add_metric([str(i), kind], d.outcomes[kind])
    yield waits
    yield outcomes
