"""The server's view of the engine loops: a thread that polls every engine's step records and every rank's
scheduler, feeds the per-step metrics, and writes SGLang's per-rank log lines:

    [2026-11-29 09:30:01 DP3] Prefill batch, #new-seq: 2, #new-token: 61, #cached-token: 0, token usage: 0.05,
        #running-req: 1, #queue-req: 0
    [2026-11-29 09:30:02 DP3] Decode batch, #running-req: 3, #token: 187, token usage: 0.09, cuda graph: True,
        gen throughput (token/s): 41.50, #queue-req: 0

A Prefill line sums the prompts that got their first token since the last poll (the poll runs every
`poll_s`); a Decode line is written every `decode_log_interval` decode steps of the rank's engine (SGLang's
--decode-log-interval), for the ranks that hold requests, with the throughput over that interval.
"""

from __future__ import annotations

import logging
import threading
import time

from jaxdp.engine.threads import start_thread

log = logging.getLogger("jaxdp.serve")


class Monitor:
    def __init__(self, backend, metrics=None, *, decode_log_interval: int = 40, poll_s: float = 0.2):
        self.backend, self.metrics = backend, metrics
        self.interval = max(1, decode_log_interval)
        self.poll_s = poll_s
        self._steps_seen = [e.stats.steps for e in backend.engines]
        self._decode_steps = [0] * len(backend.engines)
        self._gen_tokens = [0] * backend.num_ranks  # since the last decode log line
        self._since = [time.perf_counter()] * len(backend.engines)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        backend.on_token.append(self._count_tokens)

    def _count_tokens(self, rank: int, _gap: float, new: int, _first: bool) -> None:
        self._gen_tokens[rank] += new

    def start(self) -> None:
        self._thread = start_thread(self._run, "jaxdp-monitor")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # never take the server down for a log line
                log.exception("monitor poll failed")

    def poll(self) -> None:
        b = self.backend
        for rank in range(b.num_ranks):
            c = b.take_counters(rank)
            if c.new_seqs:
                s = b.rank_state(rank)
                log.info("Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                         "#running-req: %d, #queue-req: %d", c.new_seqs, c.new_tokens, c.cached_tokens,
                         s["token_usage"], s["num_running_reqs"], s["num_queue_reqs"], extra={"dp": rank})
        offset = 0
        for i, engine in enumerate(b.engines):
            self._read_steps(i, engine, offset)
            if self._decode_steps[i] >= self.interval:
                self._decode_lines(i, engine, offset)
            offset += engine.layout.dp

    def _read_steps(self, i: int, engine, offset: int) -> None:
        stats = engine.stats
        steps, records = stats.steps, list(stats.records)  # list() of a deque runs in C: a consistent copy
        new = min(steps - self._steps_seen[i], len(records))
        self._steps_seen[i] = steps
        if new <= 0 and self.metrics is not None and time.perf_counter() - self._since[i] > 5:
            for rank in range(offset, offset + engine.layout.dp):  # idle: no throughput to report
                self.metrics.gen_throughput[rank] = 0.0
        for rec in records[len(records) - new:] if new > 0 else []:
            if rec.kind == "decode":
                self._decode_steps[i] += 1
            if self.metrics is not None:
                self.metrics.observe_step(i, offset, rec)

    def _decode_lines(self, i: int, engine, offset: int) -> None:
        now = time.perf_counter()
        elapsed = max(now - self._since[i], 1e-9)
        graph = not engine.cfg.disable_cuda_graph
        for local in range(engine.layout.dp):
            rank = offset + local
            tokens, self._gen_tokens[rank] = self._gen_tokens[rank], 0
            throughput = tokens / elapsed
            if self.metrics is not None:
                self.metrics.gen_throughput[rank] = throughput
            s = self.backend.rank_state(rank)
            if not s["num_running_reqs"] and not tokens:
                continue
            log.info("Decode batch, #running-req: %d, #token: %d, token usage: %.2f, cuda graph: %s, "
                     "gen throughput (token/s): %.2f, #queue-req: %d", s["num_running_reqs"], s["num_tokens"],
                     s["token_usage"], graph, throughput, s["num_queue_reqs"], extra={"dp": rank})
        self._decode_steps[i] = 0
        self._since[i] = now


class RankFormatter(logging.Formatter):
    """`[time DPn] message` for per-rank lines (records with `extra={"dp": n}`), `[time] message` otherwise."""

    def __init__(self):
        super().__init__(datefmt="%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        dp = getattr(record, "dp", None)
        where = f" DP{dp}" if dp is not None else ""
        return f"[{self.formatTime(record, self.datefmt)}{where}] {super().format(record)}"
