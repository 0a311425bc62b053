"""Issue 18's soak (`-m slow`; docs/reliability.md): 2,000 requests at 256 at once against a dp=8 server, with
client aborts (before the answer, or in the middle of a stream) and bad requests mixed in, seeded. Nothing
may be lost: every good request ends with exactly the greedy tokens its prompt gets alone, every bad one
gets a 4xx, and afterwards every rank is idle with every page back in its pool. `run_soak` is also run
small (200 requests at 32) on the fuzz test's server in CI (test_fuzz_server.py).

    python -m pytest -m slow -q tests/test_reliability_soak.py
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import random
import time

import httpx
import pytest
from servers import Server
from test_reliability import HAVE_DEFAULT

pytestmark = pytest.mark.skipif(not HAVE_DEFAULT, reason="the soak reads text through the default model")
PROMPTS = [f"{a}+{b}=" for a, b in ((12, 34), (7, 8), (99, 1), (250, 250), (31, 69), (5, 0), (63, 36), (18, 27),
                                     (404, 96), (3, 4), (77, 23), (120, 5), (41, 59), (8, 8), (500, 499), (11, 22))]
BAD = [(b"{", "/generate"), (b'{"text": "1+1=", "sampling_params": {"top_k": 4294967296}}', "/generate"),
       (b'{"prompt": "1+1=", "n": 99}', "/v1/completions"), (b'{"text": "\\ud800"}', "/generate"),
       (b'{"messages": []}', "/v1/chat/completions"), (b'{"input_ids": [1, 99999]}', "/generate")]


@dataclasses.dataclass
class Tally:
    ok: int = 0
    lost: list = dataclasses.field(default_factory=list)  # (what, why) of good requests that did not come back right
    refused: int = 0
    aborted: int = 0


def _native(prompt: str, max_new: int, **extra) -> dict:
    return {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}, **extra}


async def _one(c: httpx.AsyncClient, rng: random.Random, solo: dict, tally: Tally, max_new: int) -> None:
    u, prompt = rng.random(), rng.choice(PROMPTS)
    try:
        await _request(c, rng, u, prompt, solo, tally, max_new)
    except httpx.HTTPError as e:  # a timeout or a dropped connection: lost
        kind = ("bad", "left before the answer", "left a stream", "native", "stream", "openai")[
            sum(u >= x for x in (0.04, 0.10, 0.15, 0.55, 0.75))]
        tally.lost.append((kind, f"{type(e).__name__}: {e}"))


async def _request(c: httpx.AsyncClient, rng: random.Random, u: float, prompt: str, solo: dict, tally: Tally,
                   max_new: int) -> None:
    if u < 0.04:  # a bad request
        raw, path = rng.choice(BAD)
        r = await c.post(path, content=raw, headers={"Content-Type": "application/json"})
        if 400 <= r.status_code < 500 and r.json()["error"]["message"]:
            tally.refused += 1
        else:
            tally.lost.append((path, f"bad request answered {r.status_code}"))
        return
    if u < 0.10:  # the client leaves before the answer comes
        try:
            await asyncio.wait_for(c.post("/generate", json=_native(prompt, 200)), rng.uniform(0.01, 0.5))
        except TimeoutError:
            pass
        tally.aborted += 1
        return
    if u < 0.15:  # the client leaves in the middle of a stream
        async with c.stream("POST", "/generate", json=_native(prompt, 200, stream=True)) as r:
            lines = 0
            async for _ in r.aiter_lines():
                lines += 1
                if lines >= rng.randint(1, 6):
                    break
        tally.aborted += 1
        return
    if u < 0.55:
        r = await c.post("/generate", json=_native(prompt, max_new))
        got = r.json().get("output_ids") if r.status_code == 200 else r.text
        want = solo[prompt]["output_ids"]
    elif u < 0.75:
        async with c.stream("POST", "/generate", json=_native(prompt, max_new, stream=True)) as r:
            events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
        got = json.loads(events[-1][6:]).get("output_ids", events[-1]) if events else "no events"
        want = solo[prompt]["output_ids"]
    else:
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_new, "temperature": 0})
        got = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        want = solo[prompt]["text"]
    if got == want:
        tally.ok += 1
    else:
        tally.lost.append((prompt, f"got {str(got)[:120]}, alone {want}"))


def run_soak(server, total: int, concurrency: int, seed: int = 0, max_new: int = 8, timeout: float = 120) -> Tally:
    """`total` seeded requests, `concurrency` at a time; asserts nothing is lost and every page comes back.
    `timeout`: how long a client waits for one answer (a late answer counts as lost)."""
    solo = {p: httpx.post(server.url + "/generate", json=_native(p, max_new), timeout=60).json() for p in PROMPTS}
    rng = random.Random(seed)
    tally = Tally()

    async def run() -> None:
        # idle connections expire on the client before uvicorn closes them (5 s): otherwise a request sent on
        # one the server is closing at that moment fails (HTTP/1.1's keep-alive race, no fault of the server)
        limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as c:
            gate = asyncio.Semaphore(concurrency)

            async def gated(r: random.Random) -> None:
                async with gate:
                    await _one(c, r, solo, tally, max_new)

            await asyncio.gather(*(gated(random.Random(rng.random())) for _ in range(total)))

    t0 = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - t0
    print(f"soak: {total} requests at {concurrency} in {elapsed:.1f} s: {tally.ok} right, {tally.refused} refused, "
          f"{tally.aborted} aborted by their clients, {len(tally.lost)} lost")
    assert not tally.lost, (collections.Counter((kind, why.split(":")[0]) for kind, why in tally.lost),
                            tally.lost[:5], _log_errors(server))
    assert tally.ok + tally.refused + tally.aborted == total, tally
    for _ in range(150):
        states = httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"]
        if all(s["num_reqs"] == 0 for s in states):
            break
        time.sleep(0.2)
    assert all(s["num_reqs"] == 0 and s["free_pages"] + s["cached_pages"] == s["num_pages"] for s in states), states
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    return tally


def _log_errors(server) -> list[str]:
    log = getattr(server, "log", None)
    lines = log.read_text().splitlines() if log is not None and log.exists() else []
    return [line for line in lines if "rror" in line or "xception" in line][:20]


@pytest.mark.slow
def test_soak_2000_requests_at_256(tmp_path):
    s = Server(["--mesh", "dp=8", "--max-total-tokens", "4096", "--max-running-requests", "256",
                "--chunked-prefill-size", "256", "--cuda-graph-bs", "1", "4", "16", "32"], tmp_path / "soak.log")
    try:
        tally = run_soak(s.wait(), total=2000, concurrency=256, seed=18, timeout=1800)  # 2 busy cores: slow steps
        assert tally.aborted > 50 and tally.refused > 20
    finally:
        s.stop()
