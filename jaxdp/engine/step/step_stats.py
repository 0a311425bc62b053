"""What the loop measured, step by step: the figures the logs, /metrics and the benchmark report."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from jax import monitoring

from jaxdp.parallel.accounting import StepAccount
from jaxdp.parallel.agreement import Agreement
from jaxdp.parallel.step import StepShape

_compile_lock = threading.Lock()
_compiles = [0]
_on_thread = threading.local()  # compiles of the thread that asked for them: an engine's loop thread is its own


def _on_event(name: str, _secs: float, **_kw) -> None:
    if name == "/jax/core/compile/backend_compile_duration":  # reported on the thread that compiled
        with _compile_lock:
            _compiles[0] += 1
        _on_thread.count = getattr(_on_thread, "count", 0) + 1


monitoring.register_event_duration_secs_listener(_on_event)


def compiles_total() -> int:
    """XLA compilations in this process so far (every jit, not only the engine's)."""
    return _compiles[0]


def compiles_on_this_thread() -> int:
    """XLA compilations this thread asked for so far: an engine counts its own steps' compiles with it, so two
    replicas in one process never count each other's."""
    return getattr(_on_thread, "count", 0)


@dataclasses.dataclass
class StepRecord:
    kind: str
    rows: list[int]
    bucket: int
    gather_mode: str
    idle_ranks: int
    padding_ratio: float  # rows computed by attention / rows needed
    imbalance: float  # busiest rank's rows over the mean
    host_s: float
    dispatch_s: float
    wait_s: float
    new_tokens: int
    agree_s: float = 0.0  # time in the agreement (part of host_s; across hosts: the exchange)

    @property
    def step_s(self) -> float:
        return self.host_s + self.dispatch_s + self.wait_s


class StepStats:
    def __init__(self, dp: int, keep: int = 4096):
        self.dp = dp
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=keep)
        self.steps = 0
        self.tokens = 0
        self.compiles_in_steps = 0  # compiles that happened inside a serving step (after warm-up: a bug)

    def record(self, shape: StepShape, rows: list[int], agreement: Agreement, account: StepAccount | None, *,
               host_s: float, dispatch_s: float, wait_s: float, compiled: int, new_tokens: int,
               agree_s: float = 0.0) -> None:
        needed = max(sum(rows), 1)
        mean = sum(rows) / len(rows)
        self.records.append(StepRecord(
            shape.kind, rows, shape.num_rows, shape.gather_mode, len(agreement.idle_ranks),
            shape.num_rows * len(rows) / needed, max(rows) / mean if mean else 1.0,
            host_s, dispatch_s, wait_s, new_tokens, agree_s))
        self.steps += 1
        self.tokens += new_tokens
        self.compiles_in_steps += compiled
        self.last_account = account

    def summary(self) -> dict[str, float]:
        recs = list(self.records)
        if not recs:
            return {}
        step = sum(r.step_s for r in recs)
        host = sum(r.host_s for r in recs)
        return {
            "steps": len(recs), "tokens": sum(r.new_tokens for r in recs),
            "step_ms": 1e3 * step / len(recs), "host_ms": 1e3 * host / len(recs),
            "host_share": host / step if step else 0.0,
            "padding_ratio": sum(r.padding_ratio for r in recs) / len(recs),
            "rows_per_rank": sum(sum(r.rows) for r in recs) / len(recs) / self.dp,
            "idle_ranks": sum(r.idle_ranks for r in recs) / len(recs),
            "imbalance": sum(r.imbalance for r in recs) / len(recs),
        }


@dataclasses.dataclass
class Launched:
    """A step's results: on the device once queued, read back (numpy, this node's ranks) once booked."""

    tokens: Any  # [dp, token_carry]
    logprobs: Any
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the step kind's own, by name: tuples of arrays


@dataclasses.dataclass
class InFlight:
    """A step queued on the device whose tokens have not been read back yet, its kind (which books it) and its
    figures so far."""

    kind: Any  # the StepKind that queued it (jaxdp.engine.step.pipeline)
    plans: list
    out: Launched
    shape: StepShape
    rows: list[int]
    agreement: Any
    account: Any
    host_s: float
    dispatch_s: float
    agree_s: float
