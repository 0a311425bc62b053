"""`python -m jaxdp.bench.deterministic`: SGLang's determinism test (`sglang.test.test_deterministic`) as a
jaxdp command, against a running server's native `/generate` (jaxdp's or SGLang's).

It sends the same prompts again and again in different company and counts, for each prompt, the distinct
answers: by token ids, and by token ids together with their logprobs compared bit for bit (`return_logprob`).
A server whose output does not depend on what else is batched with a request answers "Unique samples: 1".

- `--mode single`: one prompt (the probe), sent once a trial among a random number of random other prompts
  (concurrent requests; the first trial alone), pinned to a different DP rank each trial where the server has
  several; with `--prefix-cache mixed` every other trial starts from a flushed prefix cache, so the probe is
  served both with and without a cache hit.
- `--mode mixed`: several prompts (short and long answers) in random proportions, each request on a random rank.
- `--mode prefix`: prompts that share prefixes of different lengths of one text, drawn at random into each
  trial's batch, the prefix cache flushed before each trial (within a trial they share its pages).

Temperature 0 by default; `--temperature 1 --seed N` samples with a fixed seed (SGLang's `sampling_seed`).
It prints one line per prompt in SGLang's words and a table, and `--output FILE` writes every sample (ids,
logprobs, rank, batch size, cached tokens) as JSON. The server must be on this machine (loopback), and the
run is bounded: at most MAX_TRIALS trials of MAX_BATCH requests, and `--time-limit` seconds (the trials done
by then are reported, marked as stopped early).

    python -m jaxdp.bench.deterministic --mode single --url http://127.0.0.1:30000 --trials 12 --output d.json
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import string
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import aiohttp
import numpy as np

MODES = ("single", "mixed", "prefix")
MAX_TRIALS = 1000
MAX_BATCH = 256
PREFIX_CACHE = ("mixed", "flush", "keep")


class DeterminismError(Exception):
    """A user-facing failure: printed as one `error: ...` line, exit status 2."""


@dataclass
class Sample:
    """One answer to one of the prompts: what it returned and the company it was served in."""

    prompt: int
    trial: int
    batch_size: int
    pinned_rank: int | None
    dp_rank: int | None
    cached_tokens: int | None
    finish_reason: str | None
    output_ids: list[int]
    logprobs: list[float | None]


@dataclass
class PromptCount:
    """The distinct answers one prompt received."""

    prompt: int
    text: str
    samples: int
    unique_ids: int
    unique_ids_logprobs: int
    max_logprob_gap: float  # largest |logprob - the first sample's| over the samples with the first's ids
    cold: tuple[int, int]  # (samples, distinct ids + logprobs) among those served with no prefix-cache hit
    cached: tuple[int, int]  # the same among those served after a prefix-cache hit (cached_tokens > 0)
    ranks: dict[str, int] = field(default_factory=dict)


def letters(rng: np.random.Generator, n: int) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), size=n))


def other_prompt(rng: np.random.Generator) -> str:
    """A random prompt in the embedded model's skills (its card): short arithmetic or a long reversal."""
    kind = rng.integers(4)
    a, b = (int(x) for x in rng.integers(1, 100, size=2))
    if kind == 0:
        return f"{a}+{b}="
    if kind == 1:
        return f"{max(a, b)}-{min(a, b)}="
    if kind == 2:
        return f"{a}*{int(rng.integers(2, 10))}="
    return f"reverse {letters(rng, int(rng.integers(16, 49)))}="


def mode_prompts(args, rng: np.random.Generator) -> list[str]:
    """The prompts whose answers are counted: the probe (single), a short and a long mix (mixed), or the
    shared-prefix family (prefix)."""
    if args.mode == "single":
        return [args.prompt or f"reverse {letters(rng, 40)}="]
    if args.mode == "mixed":
        return args.prompts or ["37+48=", "23*4=", f"reverse {letters(rng, 24)}=", f"sort {letters(rng, 48)}="]
    words = [letters(rng, int(rng.integers(8, 25))) for _ in range(40)]
    base = args.prompt or " ".join(f"reverse {w}={w[::-1]}" for w in words)
    if max(args.prefix_lengths) > len(base):
        raise DeterminismError(f"--prefix-lengths asks for {max(args.prefix_lengths)} characters of a prompt of "
                               f"{len(base)}; give shorter lengths or a longer --prompt")
    return [base[:n] for n in args.prefix_lengths]


@dataclass
class Slot:
    """One request of a trial: which counted prompt it carries (None: filler) and its text and rank."""

    prompt: int | None
    text: str
    rank: int | None


def trial_slots(args, t: int, prompts: list[str], ranks: list[int], rng: np.random.Generator) -> list[Slot]:
    """Trial t's requests (t from 0): the mode's mixture at a random batch size (the first single trial alone)."""
    size = 1 if (args.mode == "single" and t == 0) else int(rng.integers(1, args.max_batch + 1))
    pick = (lambda: int(rng.choice(ranks))) if ranks else (lambda: None)
    if args.mode == "single":  # two trials a rank: with `--prefix-cache mixed` the first cold, the second cached
        probe_rank = ranks[(t // 2) % len(ranks)] if ranks else None
        slots = [Slot(None, other_prompt(rng), pick()) for _ in range(size - 1)]
        slots.insert(int(rng.integers(size)), Slot(0, prompts[0], probe_rank))
        return slots
    return [Slot(i, prompts[i], pick()) for i in rng.integers(len(prompts), size=size).tolist()]


def flush_this_trial(args, t: int) -> bool:
    """Whether trial t starts from a flushed prefix cache: prefix mode always (as SGLang's), else per
    `--prefix-cache` (mixed: every other trial, so the probe comes both cold and cached)."""
    if args.mode == "prefix" or args.prefix_cache == "flush":
        return True
    return args.prefix_cache == "mixed" and t % 2 == 0


def request_body(args, slot: Slot) -> dict:
    params: dict = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.seed is not None:
        params["sampling_seed"] = args.seed  # SGLang's name; jaxdp takes it too
    body: dict = {"text": slot.text, "sampling_params": params, "return_logprob": True}
    if slot.rank is not None:
        body["routed_dp_rank"] = slot.rank
    return body


def parse_answer(answer: dict) -> tuple[list[int], list[float | None], dict]:
    """(token ids, their logprobs, meta_info) of one /generate answer."""
    meta = answer.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise DeterminismError("the server's /generate answer has no meta_info.output_token_logprobs; it must "
                               "support return_logprob (jaxdp's and SGLang's native API do)")
    ids = answer.get("output_ids")
    if not isinstance(ids, list):  # SGLang versions without output_ids: the ids of the logprob triples
        ids = [int(t[1]) for t in triples]
    return [int(i) for i in ids], [None if t[0] is None else float(t[0]) for t in triples], meta


async def post_json(client: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with client.post(url, json=body) as r:
        text = await r.text()
        if r.status != 200:
            raise DeterminismError(f"{url} answered HTTP {r.status}: {text[:300]}")
        return json.loads(text)


async def run_trial(client: aiohttp.ClientSession, args, t: int, slots: list[Slot]) -> list[Sample]:
    answers = await asyncio.gather(*(post_json(client, args.url + "/generate", request_body(args, s))
                                     for s in slots))
    samples = []
    for slot, answer in zip(slots, answers, strict=True):
        if slot.prompt is None:
            continue
        ids, lps, meta = parse_answer(answer)
        reason = meta.get("finish_reason")  # SGLang's {"type": "stop", ...}
        samples.append(Sample(slot.prompt, t, len(slots), slot.rank, meta.get("dp_rank"), meta.get("cached_tokens"),
                              reason.get("type") if isinstance(reason, dict) else reason, ids, lps))
    return samples


async def flush_cache(client: aiohttp.ClientSession, args, tries: int = 20) -> bool:
    """Ask the server to flush its prefix cache, retrying while it refuses (it does while requests run, and the
    last trial's may still be finishing); False when it never agreed."""
    for _ in range(tries):
        async with client.post(args.url + "/flush_cache") as r:
            await r.read()
            if r.status == 200:
                return True
        await asyncio.sleep(0.25)
    return False


def logprob_key(lps: list[float | None]) -> tuple:
    """Logprobs as exact bit patterns (float.hex), so that equal means bit-identical (NaN included)."""
    return tuple("none" if v is None else float(v).hex() for v in lps)


def distinct(samples: list[Sample]) -> int:
    """How many different (token ids, logprobs bit for bit) the samples hold."""
    return len({(tuple(s.output_ids), logprob_key(s.logprobs)) for s in samples})


def count(prompts: list[str], samples: list[Sample]) -> list[PromptCount]:
    """Per prompt: samples, distinct token-id sequences, distinct (ids, logprobs bit for bit), the largest
    logprob gap to the first sample among those with the same ids, and the distinct ones apart for the samples
    served without and with a prefix-cache hit."""
    out = []
    for i, text in enumerate(prompts):
        mine = [s for s in samples if s.prompt == i]
        gap = 0.0
        if mine:
            first = mine[0]
            for s in mine[1:]:
                if s.output_ids == first.output_ids:
                    gap = max([gap, *(abs(a - b) for a, b in zip(s.logprobs, first.logprobs, strict=True)
                                      if a is not None and b is not None)])
        cold = [s for s in mine if not s.cached_tokens]
        cached = [s for s in mine if s.cached_tokens]
        out.append(PromptCount(i, text, len(mine), len({tuple(s.output_ids) for s in mine}), distinct(mine), gap,
                               (len(cold), distinct(cold)), (len(cached), distinct(cached)),
                               dict(sorted(Counter(str(s.dp_rank) for s in mine).items()))))
    return out


async def server_ranks(client: aiohttp.ClientSession, args) -> list[int]:
    """The DP ranks to pin to: `--ranks`, or with `auto` every rank the server reports (jaxdp's num_ranks,
    SGLang's dp_size); [] means unpinned."""
    if args.ranks == "none":
        return []
    if args.ranks != "auto":
        return args.rank_list
    try:
        async with client.get(args.url + "/server_info") as r:
            info = await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, ValueError):
        info = {}
    n = info.get("num_ranks") or info.get("dp_size") or 1
    return list(range(int(n))) if int(n) > 1 else []


async def run_async(args) -> dict:
    rng = np.random.default_rng(args.rng_seed)
    prompts = mode_prompts(args, rng)
    samples: list[Sample] = []
    trials: list[dict] = []
    stopped = None
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as client:
        try:
            async with client.get(args.url + "/health") as r:
                if r.status != 200:
                    raise DeterminismError(f"{args.url}/health answered {r.status}; wait until the server is up")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DeterminismError(f"cannot reach the server at {args.url} ({type(e).__name__}); start it or "
                                   "fix --url") from None
        ranks = await server_ranks(client, args)
        for _ in range(args.warmup):  # compiles and first-touch costs out of the way, answers not counted
            await run_trial(client, args, -1, [Slot(None, other_prompt(rng), None) for _ in range(4)])
        start = time.perf_counter()
        for t in range(args.trials):
            if time.perf_counter() - start > args.time_limit:
                stopped = f"the time limit of {args.time_limit:g} s passed after {t} trials"
                break
            slots = trial_slots(args, t, prompts, ranks, rng)
            flushed = await flush_cache(client, args) if flush_this_trial(args, t) else None
            try:
                got = await run_trial(client, args, t, slots)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise DeterminismError(f"trial {t} failed ({type(e).__name__}: {e}); is the server still up?") \
                    from None
            samples.extend(got)
            trials.append({"trial": t, "batch_size": len(slots), "flushed": flushed,
                           "counted": [s.prompt for s in slots if s.prompt is not None],
                           "ranks": [s.rank for s in slots]})
        duration = time.perf_counter() - start
    counts = count(prompts, samples)
    config = {k: v for k, v in vars(args).items() if k not in ("rank_list",)}
    return {"config": config, "ranks_pinned": ranks, "duration_s": duration, "stopped_early": stopped,
            "counts": [asdict(c) for c in counts], "trials": trials, "samples": [asdict(s) for s in samples]}


def report(result: dict) -> str:
    """SGLang's lines ("Prompt i: total samples: N, Unique samples: K") and a table of both counts."""
    counts = result["counts"]
    lines = [f"Prompt {c['prompt']}: total samples: {c['samples']}, Unique samples: {c['unique_ids']} "
             f"(token ids), {c['unique_ids_logprobs']} (token ids + logprobs, bit for bit)" for c in counts]
    head = ("prompt", "samples", "unique ids", "unique ids+logprobs", "cold", "cached", "max |dlogprob|",
            "served by rank: count")
    split = lambda pair: f"{pair[1]} of {pair[0]}" if pair[0] else "-"
    rows = [(f"{c['prompt']}: {c['text'][:20]!r} ({len(c['text'])} ch)", str(c["samples"]), str(c["unique_ids"]),
             str(c["unique_ids_logprobs"]), split(c["cold"]), split(c["cached"]), f"{c['max_logprob_gap']:.3g}",
             " ".join(f"{r}:{n}" for r, n in c["ranks"].items()) or "-") for c in counts]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: " | ".join(v.ljust(w) if i in (0, len(head) - 1) else v.rjust(w) for i, (v, w) in
                               enumerate(zip(r, widths, strict=True))).rstrip()
    lines += ["", fmt(head), "-" * (sum(widths) + 3 * (len(widths) - 1)), *map(fmt, rows)]
    mode = result["config"]["mode"]
    lines.append("cold / cached: distinct ids + logprobs among the samples served without / with a prefix-cache hit")
    lines.append(f"mode {mode}, {len(result['trials'])} trials in {result['duration_s']:.1f} s, "
                 f"ranks pinned: {result['ranks_pinned'] or 'none'}")
    if result["stopped_early"]:
        lines.append(f"stopped early: {result['stopped_early']}")
    return "\n".join(lines)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise DeterminismError(message)


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise DeterminismError(f"{flag} {text!r}: expected integers like 1,48,160") from None
    if any(v < 0 for v in values):
        raise DeterminismError(f"{flag} {text!r}: values must not be negative")
    return values


def check_loopback(url: str) -> str:
    """The URL without a trailing slash, refused unless its host is this machine."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if parts.scheme not in ("http", "https") or not local:
        raise DeterminismError(f"--url {url!r}: the command sends its requests only to a server on this machine; "
                               "give http://127.0.0.1:PORT")
    return url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m jaxdp.bench.deterministic", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="single")
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the server (loopback only)")
    p.add_argument("--trials", type=int, default=12, help=f"batches sent one after another (at most {MAX_TRIALS})")
    p.add_argument("--max-batch", type=int, default=16,
                   help=f"a trial's batch size is uniform in 1..this (at most {MAX_BATCH} concurrent requests)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, help="sampling seed (SGLang's sampling_seed); needed with --temperature > 0")
    p.add_argument("--ranks", default="auto", help="auto (every rank the server has), none, or a list like 0,3")
    p.add_argument("--prefix-cache", choices=PREFIX_CACHE, default="mixed",
                   help="single and mixed modes: flush the prefix cache before every other trial (mixed), "
                        "every trial (flush) or never (keep); prefix mode always flushes")
    p.add_argument("--prompt", help="single: the probe prompt; prefix: the text whose prefixes are the prompts")
    p.add_argument("--prompts", help="mixed: the prompts, separated by '|' (default: a mix of short and long)")
    p.add_argument("--prefix-lengths", default="1,48,160,320", help="prefix: the prompts' lengths in characters")
    p.add_argument("--warmup", type=int, default=1, help="uncounted batches of 4 sent first")
    p.add_argument("--rng-seed", type=int, default=0, help="seed of the batch sizes, filler prompts and ranks")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--time-limit", type=float, default=900.0, help="no trial starts after this many seconds")
    p.add_argument("--output", help="write the counts and every sample as JSON")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags of `argv`, checked (DeterminismError in one sentence for a value out of range)."""
    args = build_parser().parse_args(argv)
    args.url = check_loopback(args.url)
    if not 1 <= args.trials <= MAX_TRIALS:
        raise DeterminismError(f"--trials must be in 1..{MAX_TRIALS}")
    if not 1 <= args.max_batch <= MAX_BATCH:
        raise DeterminismError(f"--max-batch must be in 1..{MAX_BATCH}")
    if args.max_new_tokens < 1 or args.warmup < 0 or args.timeout <= 0 or args.time_limit <= 0:
        raise DeterminismError("--max-new-tokens, --timeout and --time-limit must be positive, --warmup not negative")
    if args.temperature < 0:
        raise DeterminismError("--temperature must be 0 (greedy) or more")
    if args.temperature > 0 and args.seed is None:
        raise DeterminismError("--temperature above 0 needs --seed N: unseeded samples differ by design")
    args.rank_list = None if args.ranks in ("auto", "none") else int_list(args.ranks, "--ranks")
    args.prefix_lengths = int_list(args.prefix_lengths, "--prefix-lengths")
    if args.mode == "prefix" and (not args.prefix_lengths or min(args.prefix_lengths) < 1):
        raise DeterminismError("--prefix-lengths must be at least 1 character each")
    args.prompts = [s for s in args.prompts.split("|") if s] if args.prompts else None
    if args.prompt is not None and not args.prompt:
        raise DeterminismError("--prompt must not be empty")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        result = asyncio.run(run_async(args))
    except DeterminismError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:  # first: a report cut short (a closed pipe) still leaves the samples
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
