"""The prefill delayer (`--enable-prefill-delayer`; the article's section 8.2): a rank with a prompt waits until
every rank has one, so the decoding requests are held up by one prompt step instead of one per rank.

Each pass of the loop, every rank adds two numbers to the agreement (`RankSignal`): "a prompt is ready" and
"my token usage is under the watermark". `decide` is the rule over everyone's numbers; every rank (and every
node: the numbers ride on the exchange) computes it from the same numbers and the same count of passes waited,
so all reach the same decision without talking again. A decision is acted on in the next pass: a rank starts a
new prompt only after it announced it, which is what lets the others hear of it first.

- no rank has a prompt, or every rank has one: nothing to wait for;
- some rank's token usage is under the watermark (and it has a prompt): little is decoding there, so there is
  nothing to protect and no one waits;
- otherwise the ranks with a prompt wait, for at most `max_delay_passes` passes, then go ahead.

A rank in the middle of a chunked prompt is never held (its next chunk goes on), and the rule does not touch
the decoding requests.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

# how a pass ended, as SGLang names them: no rank had a prompt, all had one without waiting, all had one after
# waiting, the watermark let the prompts go, a wait pass, the wait limit let the prompts go
OUTCOMES = ("no_prompt", "no_wait", "wait_success", "token_watermark", "delay", "wait_timeout")


@dataclasses.dataclass(frozen=True)
class RankSignal:
    """What one rank adds to the agreement."""

    prompt_ready: bool  # it has a prompt to read (a new one, or the rest of one it is reading)
    under_watermark: bool  # it has one and its token usage is under the watermark


@dataclasses.dataclass(frozen=True)
class Decision:
    hold: bool  # ranks with a new prompt keep it back in the next pass
    waited: int  # passes waited so far in this wait (0 when none is going on)
    outcome: str  # one of OUTCOMES


def decide(signals: Sequence[RankSignal], waited: int, max_delay_passes: int) -> Decision:
    """The delayer's rule over every rank's numbers and the passes waited so far."""
    ready = [s.prompt_ready for s in signals]
    if not any(ready):
        return Decision(False, 0, "no_prompt")
    if all(ready):
        return Decision(False, 0, "wait_success" if waited else "no_wait")
    if any(s.prompt_ready and s.under_watermark for s in signals):
        return Decision(False, 0, "token_watermark")
    if waited >= max_delay_passes:
        return Decision(False, 0, "wait_timeout")
    return Decision(True, waited + 1, "delay")


def rank_signal(prompt_ready: bool, token_usage: float, watermark: float | None) -> RankSignal:
    return RankSignal(prompt_ready, prompt_ready and watermark is not None and token_usage < watermark)


@dataclasses.dataclass
class DelayerConfig:
    max_delay_passes: int = 30
    token_usage_low_watermark: float | None = None  # None: the watermark never lets a prompt go early

    def validate(self) -> DelayerConfig:
        if self.max_delay_passes < 0:
            raise ValueError(f"--prefill-delayer-max-delay-passes must be 0 or more, got {self.max_delay_passes}")
        w = self.token_usage_low_watermark
        if w is not None and not 0.0 <= w <= 1.0:
            raise ValueError(f"--prefill-delayer-token-usage-low-watermark is a share of the KV pool in [0, 1], "
                             f"got {w}")
        return self


class PrefillDelayer:
    """The engine's side: the last agreement's numbers, the decision they gave, and the counters for /metrics."""

    def __init__(self, cfg: DelayerConfig, dp: int):
        self.cfg = cfg.validate()
        self.announced = [False] * dp  # each rank's "prompt ready" in the last agreement
        self.decision = Decision(False, 0, "no_prompt")
        self.wait_passes = 0  # passes in which some rank held a prompt back (jaxdp:prefill_delayer_wait_passes)
        self.outcomes: Counter[str] = Counter()
        self.pass_again = False

    def may_start_prompt(self, rank: int) -> bool:
        """Whether `rank` may start a new prompt in this pass (it announced one, and no one is waiting)."""
        return self.announced[rank] and not self.decision.hold

    def signals(self, prompt_ready: Sequence[bool], token_usage: Sequence[float]) -> list[tuple[bool, bool]]:
        """This node's ranks' numbers for the exchange (plain tuples: small on the wire)."""
        w = self.cfg.token_usage_low_watermark
        return [dataclasses.astuple(rank_signal(p, u, w)) for p, u in zip(prompt_ready, token_usage, strict=True)]

    def post(self, message, schedulers: Sequence) -> None:
        """Add this node's ranks' numbers (their schedulers, in rank order) to its message of the exchange (a
        `jaxdp.engine.ipc.messages.NodeMessage`)."""
        message.prefill_delayer = self.signals([s.prompt_ready for s in schedulers],
                                               [s.token_usage for s in schedulers])

    def read(self, messages: Sequence) -> Decision:
        """Every node's message of this pass, in node order (each node's ranks are contiguous)."""
        return self.update([signal for m in messages for signal in m.prefill_delayer])

    def update(self, signals: Sequence[RankSignal | tuple[bool, bool]]) -> Decision:
        """Take every rank's numbers from this pass's agreement; the decision applies to the next pass."""
        sigs = [s if isinstance(s, RankSignal) else RankSignal(*s) for s in signals]
        self.decision = decide(sigs, self.decision.waited, self.cfg.max_delay_passes)
        # loop again at once (even with no step to run) while a wait goes on or a prompt was just announced
        self.pass_again = self.decision.hold or any(s.prompt_ready and not a for s, a in zip(sigs, self.announced,
                                                                                              strict=True))
        self.announced = [s.prompt_ready for s in sigs]
        if self.decision.outcome != "no_prompt":  # (a pass with no prompt anywhere is not an outcome)
            self.outcomes[self.decision.outcome] += 1
        self.wait_passes += self.decision.hold
        return self.decision
