"""The stop rule (`jaxdp.engine.sched.finish.finish_reason`): each condition alone, their order, and the engine's
booking asking it (over `HostOnlyRunner`, whose every sampled token is 1)."""

from __future__ import annotations

import pytest

from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.engine.sched.finish import finish_reason
from jaxdp.engine.sched.request import Request, stop_string_check
from jaxdp.testing import HostOnlyRunner

EOS = frozenset({2})


class Letters:
    """A tokenizer stand-in: token t is the letter chr(ord('a') + t)."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(ord("a") + t) for t in ids)


def request(output: list[int], **params) -> Request:
    req = Request("r", [5, 6, 7], SamplingParams(**params))
    req.output_ids = list(output)
    if req.params.stop:
        req.stop_check = stop_string_check(Letters(), req.params.stop)
    return req


def test_eos_stops_a_request():
    assert finish_reason(request([4, 2]), 2, 2, 10, EOS) == "stop"


def test_ignore_eos_goes_past_eos():
    assert finish_reason(request([4, 2], ignore_eos=True), 2, 2, 10, EOS) is None


def test_a_stop_token_id_stops_a_request_even_when_it_ignores_eos():
    assert finish_reason(request([4, 9], stop_token_ids=[9]), 9, 2, 10, EOS) == "stop"
    assert finish_reason(request([4, 9], stop_token_ids=[9], ignore_eos=True), 9, 2, 10, EOS) == "stop"
    assert finish_reason(request([4, 8], stop_token_ids=[9]), 8, 2, 10, EOS) is None


def test_a_stop_string_stops_a_request_once_its_text_holds_it():
    assert finish_reason(request([7, 8], stop=["hi"]), 8, 2, 10, EOS) == "stop"  # "hi"
    assert finish_reason(request([7], stop=["hi"]), 7, 1, 10, EOS) is None  # "h"
    assert finish_reason(request([7, 8, -1], stop=["hi"]), 8, 2, 10, EOS) == "stop"  # (a marker in flight: skipped)


def test_length_ends_a_request_at_its_limit_only():
    assert finish_reason(request([4, 4, 4]), 4, 3, 3, EOS) == "length"
    assert finish_reason(request([4, 4]), 4, 2, 3, EOS) is None


def test_a_stop_at_the_limit_is_a_stop():
    assert finish_reason(request([4, 2]), 2, 2, 2, EOS) == "stop"
    assert finish_reason(request([4, 9], stop_token_ids=[9]), 9, 2, 2, EOS) == "stop"


@pytest.mark.parametrize(("params", "n_out", "reason"), [
    (SamplingParams(max_new_tokens=5, ignore_eos=True), 5, "length"),
    (SamplingParams(max_new_tokens=5, ignore_eos=True, stop_token_ids=[1]), 1, "stop"),
])
def test_the_engine_books_by_the_rule(params, n_out, reason):
    cfg = EngineConfig(page_size=4, num_pages=16, max_running_requests=4, chunked_prefill_size=16,
                       decode_buckets=[1, 2, 4], extend_buckets=[8, 16])
    eng = Engine(HostOnlyRunner("tiny", "dp=1", cfg.num_pages, cfg.page_size), "dp=1", cfg)
    (req,) = eng.generate([[5, 6, 7]], params)
    assert req.finish_reason == reason and req.output_ids == [1] * n_out
