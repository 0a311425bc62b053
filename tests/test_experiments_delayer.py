"""The prefill delayer's rule (jaxdp/engine/sched/delayer.py) on the agreement's numbers: all ranks ready, some,
the watermark, the limit, and several nodes reaching the same decision from the numbers on the exchange."""

from dataclasses import dataclass

import pytest

from jaxdp.engine.ipc.messages import NodeMessage
from jaxdp.engine.sched.delayer import DelayerConfig, PrefillDelayer, RankSignal, decide, rank_signal

R, N = RankSignal(True, False), RankSignal(False, False)  # a prompt ready / none
LOW = RankSignal(True, True)  # a prompt ready, token usage under the watermark


def test_no_prompt_or_all_ready_never_waits():
    assert decide([N, N, N, N], 0, 30).outcome == "no_prompt"
    d = decide([R, R, R, R], 0, 30)
    assert (d.hold, d.waited, d.outcome) == (False, 0, "no_wait")
    d = decide([R, R, R, R], 7, 30)  # the last rank's prompt arrived after a wait
    assert (d.hold, d.waited, d.outcome) == (False, 0, "wait_success")


def test_some_ready_waits_up_to_the_limit_then_goes():
    waited, outcomes = 0, []
    for _ in range(5):
        d = decide([R, N, N, R], waited, 3)
        waited = d.waited
        outcomes.append((d.hold, d.outcome))
    assert outcomes == [(True, "delay"), (True, "delay"), (True, "delay"), (False, "wait_timeout"), (True, "delay")]
    assert decide([R, N], 0, 0).outcome == "wait_timeout"  # a limit of 0 never waits


def test_watermark_lets_prompts_go_only_for_a_rank_with_a_prompt():
    assert decide([LOW, N, N, N], 0, 30) == decide([LOW, N, N, N], 5, 30)
    assert decide([LOW, N, N, N], 0, 30).outcome == "token_watermark"
    assert not decide([R, N, LOW, N], 2, 30).hold
    assert rank_signal(True, 0.1, 0.2) == LOW
    assert rank_signal(False, 0.1, 0.2) == N  # under the watermark without a prompt: nothing to let go
    assert rank_signal(True, 0.3, 0.2) == R and rank_signal(True, 0.0, None) == R
    assert decide([R, N, N, N], 0, 30).hold


@dataclass
class FakeRank:
    prompt_ready: bool
    token_usage: float = 0.5


def test_a_rank_starts_a_prompt_only_after_announcing_it_and_while_no_one_waits():
    d = PrefillDelayer(DelayerConfig(max_delay_passes=2), dp=2)
    assert not d.may_start_prompt(0)  # nothing announced yet: the others must hear of it first
    msg = NodeMessage()
    d.post(msg, [FakeRank(True), FakeRank(False)])
    d.read([msg])
    assert d.decision.hold and d.pass_again and not d.may_start_prompt(0)
    d.read([NodeMessage(prefill_delayer=[(True, False), (True, False)])])  # rank 1's prompt arrived: both go
    assert d.decision.outcome == "wait_success" and d.may_start_prompt(0) and d.may_start_prompt(1)
    assert d.wait_passes == 1 and d.outcomes["delay"] == 1 and d.outcomes["wait_success"] == 1
    d.read([NodeMessage(prefill_delayer=[(False, False), (False, False)])])
    assert not d.pass_again and sum(d.outcomes.values()) == 2  # a pass with no prompt is not an outcome


def test_several_nodes_decide_alike_from_the_exchanged_numbers():
    """Two nodes of two ranks each: each posts its own ranks; every node reads both messages in node order and
    so holds the same decision as one node with all four ranks."""
    passes = [[True, False, False, False], [True, False, True, False], [True, True, True, False],
              [True, True, True, True], [False, True, False, False], [False, True, False, False]]
    nodes = [PrefillDelayer(DelayerConfig(max_delay_passes=1), dp=4) for _ in range(2)]
    alone = PrefillDelayer(DelayerConfig(max_delay_passes=1), dp=4)
    seen = []
    for ready in passes:
        messages = [NodeMessage(), NodeMessage()]
        for k, node in enumerate(nodes):
            node.post(messages[k], [FakeRank(r) for r in ready[2 * k: 2 * k + 2]])
        for node in nodes:
            node.read(messages)
        alone.read([NodeMessage(prefill_delayer=[(r, False) for r in ready])])
        assert nodes[0].decision == nodes[1].decision == alone.decision
        assert nodes[0].announced == ready
        seen.append(alone.decision.outcome)
    assert seen == ["delay", "wait_timeout", "delay", "wait_success", "delay", "wait_timeout"]


def test_bad_settings_are_one_sentence():
    with pytest.raises(ValueError, match="max-delay-passes must be 0 or more"):
        DelayerConfig(max_delay_passes=-1).validate()
    with pytest.raises(ValueError, match=r"share of the KV pool in \[0, 1\]"):
        DelayerConfig(token_usage_low_watermark=1.5).validate()


def test_metrics_export_wait_passes_and_outcomes_by_kind():
    from types import SimpleNamespace

    from jaxdp.api.metrics import _delayer_metrics

    d = PrefillDelayer(DelayerConfig(max_delay_passes=1), dp=2)
    for ready in ([True, False], [True, False], [True, True]):  # delay, wait_timeout, no_wait
        d.read([NodeMessage(prefill_delayer=[(r, False) for r in ready])])
    waits, outcomes = _delayer_metrics([SimpleNamespace(delayer=d), SimpleNamespace(delayer=None)])
    assert [(s.labels, s.value) for s in waits.samples] == [({"replica": "0"}, 1.0)]
    got = {s.labels["kind"]: s.value for s in outcomes.samples}
    assert got == {"no_wait": 1.0, "wait_success": 0.0, "token_watermark": 0.0, "delay": 1.0, "wait_timeout": 1.0}
    assert waits.name == "jaxdp:prefill_delayer_wait_passes" and outcomes.name == "jaxdp:prefill_delayer_outcomes"
