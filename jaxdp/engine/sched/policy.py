"""Scheduling policies a rank's `Scheduler` is built with (never attributes assigned to it from outside).

- `Disagg`: prefill/decode disaggregation's part in scheduling (`jaxdp.engine.step.pd_sides` implements both
  sides): which requests have their prompt's KV read elsewhere, fetching it once pages are held, handing a finished
  request's KV off, and the rank's hand-off figures. `NO_DISAGG` is the plain engine's: it does nothing.
- `SpecSwitch`: speculative decoding's switch between speculative steps and plain stretches
  (`--speculative-disable-by-batch-size`, `jaxdp.engine.step.spec`), one object the pipeline sets after each
  step's agreement and every rank's scheduler reads.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from jaxdp.engine.sched.request import Request
from jaxdp.parallel.agreement import Agreement, Proposal


class Disagg(Protocol):
    """A rank's scheduler under prefill/decode disaggregation (or not: `NO_DISAGG`)."""

    def reads_elsewhere(self, req: Request) -> bool:
        """Decode side: the request's prompt is read on a prefill server; it waits for pages, then for its KV."""
        ...

    def fetch(self, rank: int, req: Request) -> None:
        """Decode side: pages for the request's prompt are held; fetch its KV into them."""
        ...

    def finished(self, rank: int, req: Request, reason: str) -> None:
        """A request finished, its pages still held (prefill side: its KV is handed off, or its room refused)."""
        ...

    def state(self, rank: int, kv_waiting: list[Request]) -> dict | None:
        """The rank's hand-off figures for its `state` (None: none), given its requests waiting for KV."""
        ...


class NoDisagg:
    """The plain engine: every prompt is read here and nothing is handed off."""

    def reads_elsewhere(self, req: Request) -> bool:
        return False

    def fetch(self, rank: int, req: Request) -> None:
        raise AssertionError("no request waits for KV from another server without disaggregation")

    def finished(self, rank: int, req: Request, reason: str) -> None:
        pass

    def state(self, rank: int, kv_waiting: list[Request]) -> dict | None:
        return None


NO_DISAGG = NoDisagg()


@dataclasses.dataclass
class SpecSwitch:
    """Whether the next step is a plain stretch's, and a quiet one's (`off_above`: --speculative-disable-by-batch-size
    N, vLLM's; None: every step speculates).

    After each step the pipeline calls `after` with its agreement (the same on every node, so every node plans the
    same kind). After a step with more than N held (running or waiting to be read, as vLLM counts them) a plain
    stretch runs: the schedulers plan as the plain engine's (prompt chunks, decodes over the persistent batch), run
    by plain steps. A stretch also goes on while no request drafts or would (`SpecScheduler.drafting`); in such a
    quiet one (N or fewer held) a new request that would speculate waits one step and is read speculatively. A
    stretch ends after a step with N or fewer held of which one drafts or would: the step in flight is booked and
    the next is a speculative one. A verify never has more than N requests (the step before it held them all); the
    one speculative step that may (decided before the agreement that shows a burst) reads prompts."""

    off_above: int | None = None
    plain: bool = False  # the next step belongs to a plain stretch: the ranks plan as the plain engine's
    quiet: bool = False  # ... a quiet one (N or fewer held, none drafting): a request that would speculate waits

    def after(self, agreement: Agreement) -> None:
        """Decide the next step's kind from this step's agreement: a stretch while more than N are held, or while no
        request drafts or would; quiet while N or fewer are held."""
        if self.off_above is None or not agreement.run:
            self.plain = self.quiet = False
            return
        many = agreement.held > self.off_above
        self.plain = many or not agreement.any_drafting
        self.quiet = self.plain and not many

    def with_held(self, proposals: list[Proposal], schedulers: list) -> list[Proposal]:
        """The ranks' proposals with what the switch decides from: the requests each holds (running or waiting to
        be read, as vLLM counts them) and whether one drafts or would (`SpecScheduler.drafting`). A rank that alone
        holds more than N makes the next step a stretch whatever drafts: its requests are not scanned."""
        if self.off_above is None:  # (no stretches: every request speculates)
            return proposals
        held = [len(s.running) + len(s.waiting) for s in schedulers]
        return [dataclasses.replace(p, held=h, drafting=h <= self.off_above and s.drafting)
                for p, h, s in zip(proposals, held, schedulers, strict=True)]
