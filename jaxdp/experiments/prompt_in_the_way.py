"""`prompt-in-the-way` (the article's section 8, Figure 8): how much a prompt on one rank slows the requests
that decode on the others, and what the prefill delayer does about it.

Pinned test: 16 decoding requests on each of ranks 1-3 run alone for 200 decode steps (300 in a full run),
then a prompt goes to rank 0 every 20 decode steps (the article's half second at 24 ms a step; measured alone,
so a slower machine sees the same shape of load), short prompts, then long ones; every decoder token's time since
the previous one is kept (ITL over time). Every phase is counted in decode steps, so the decoders' output, which
the context bounds, outlasts the run whatever a step takes. `decode_tokens_lost_pct` is how many fewer tokens
per second the decoders produce while the prompts arrive than alone. Unpinned test: 64 decoding requests and
a long prompt every 10 decode steps (the article's 4 a second) wherever the server puts them, without and with
`--enable-prefill-delayer`: the decoders' loss and the prompts' TTFT.

`--disaggregated` (the article's section 8.2, its third remedy; experiment `prompt-in-the-way-disaggregated`):
the unpinned load three ways, the same now: one colocated dp=4 server, the same with the prefill delayer, and
a prefill server (dp=4) and a decode server (dp=4) behind SGLang's router (`jaxdp.disagg.router`): every
prompt, the decoders' own included, is read on the prefill server and its KV handed to the decode server, which
never runs a prompt step. The decoders' tokens lost to the prompts beside the colocated and the delayer's, and
the prompts' TTFT (which now includes the hand-off). On this 2-core machine the two servers share the cores, so
the prefill server's work still slows the decoders through the CPU, where separate GPUs would not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import statistics
import time
from pathlib import Path

import numpy as np

from jaxdp.bench import serving as bench
from jaxdp.disagg import router
from jaxdp.experiments.runner import Context, ExperimentError, figure
from jaxdp.net import free_port

BIN_S = 0.25  # the decoders' tokens per second are counted in bins of this many seconds
SETTLE_STEPS = 20  # decode steps between the last decoder's first tokens and the start of the alone phase
ARTICLE = {"lost_pct_short": 6, "lost_pct_long": 38, "decoder_tok_s": (1270, 1610), "prompt_s": (0.30, 0.65)}


@dataclasses.dataclass
class Load:
    decoder_ranks: list[int | None]  # one entry per decoding request
    prompt_ranks: list[int | None]  # cycled over the prompts
    prompt_len: int
    interval_steps: float  # between two prompts, in decode steps measured alone (the article: 0.5 s / 24 ms)
    num_prompts: int
    alone_steps: int  # decode steps of the decoders alone before the first prompt (after they all settled)

    def decode_steps(self) -> int:
        """The decode steps a decoder must outlast: settling, alone, and the prompts' phase (at most one token a
        step while the prompts arrive, since their steps are no faster than the steps alone)."""
        return SETTLE_STEPS + self.alone_steps + math.ceil(self.num_prompts * self.interval_steps)


def run(ctx: Context) -> dict:
    # small pools, batch and context: a CPU's steps are slow, and --quick must fit in minutes
    short, long, context, alone_steps, n = _sizes(ctx.quick)
    pinned = [r for r in (1, 2, 3) for _ in range(16)]
    # prompts come every 20 decode steps pinned (the article: every 0.5 s, a step 24 ms) and every 10 unpinned
    # (4 a second), so a slower machine sees the same shape of load
    loads = {"pinned short": Load(pinned, [0], short, 20, n, alone_steps),
             "pinned long": Load(pinned, [0], long, 20, n, alone_steps),
             "unpinned long": Load([None] * 64, [None], long, 10, 2 * n, alone_steps)}
    flags = ("--max-running-requests", "80", "--max-total-tokens", str(24 * context), "--chunked-prefill-size",
             "1024", "--context-length", str(context))
    out = {}
    with ctx.server("dp=4", *flags) as url:
        for name, load in loads.items():
            out[name] = asyncio.run(_measure(url, load, context))
    with ctx.server("dp=4", *flags, "--enable-prefill-delayer", label="delayer") as url:
        out["unpinned long, delayer"] = asyncio.run(_measure(url, loads["unpinned long"], context))
    summary = {k: {x: v for x, v in r.items() if x != "itl_series"} for k, r in out.items()}
    result = {"decode_tokens_lost_pct": {"short": out["pinned short"]["lost_pct"],
                                         "long": out["pinned long"]["lost_pct"]},
              "decode_tokens_lost_pct_unpinned": out["unpinned long"]["lost_pct"],
              "decode_tokens_lost_pct_with_delayer": out["unpinned long, delayer"]["lost_pct"],
              "decoder_tok_s_during_prompts": {"without": out["unpinned long"]["rate_prompts"],
                                               "with_delayer": out["unpinned long, delayer"]["rate_prompts"]},
              "prompt_ttft_s": {"without": out["unpinned long"]["prompt_ttft_s"],
                                "with_delayer": out["unpinned long, delayer"]["prompt_ttft_s"]},
              "prompt_len": {"short": short, "long": long}, "tests": summary, "article": ARTICLE,
              "itl_series": {k: r["itl_series"][:: 1 + len(r["itl_series"]) // 1000] for k, r in out.items()}}
    fig = plot(out)
    wo, wi = out["unpinned long"], out["unpinned long, delayer"]
    table = [(f"decoder tokens lost, short prompts ({short} tokens here)", "6%",
              f"{out['pinned short']['lost_pct']:.0f}%"),
             (f"decoder tokens lost, long prompts ({long} tokens here)", "38%",
              f"{out['pinned long']['lost_pct']:.0f}%"),
             ("unpinned, long: decoder tokens lost without / with the delayer", "-",
              f"{wo['lost_pct']:.0f}% / {wi['lost_pct']:.0f}%"),
             ("unpinned, long: decoder tok/s during prompts without -> with the delayer", "1,270 -> 1,610",
              f"{wo['rate_prompts']:.0f} -> {wi['rate_prompts']:.0f}"),
             ("unpinned, long: a prompt's TTFT without -> with the delayer", "0.30 -> 0.65 s",
              f"{wo['prompt_ttft_s']:.2f} -> {wi['prompt_ttft_s']:.2f} s")]
    ctx.write(result, fig, table)
    return result


def _sizes(q: bool) -> tuple[int, int, int, int, int]:
    """(short, long, context, alone_steps, prompts) of a --quick or full run: the decoders' output (the context
    less their prompt) outlasts every load's decode steps (`Load.decode_steps`: 380 of 488, 920 of 1000)."""
    short, long, context = (64, 384, 512) if q else (128, 768, 1024)
    alone_steps, n = (200, 8) if q else (300, 30)
    return short, long, context, alone_steps, n


def run_disaggregated(ctx: Context) -> dict:
    """The unpinned long load on one colocated server, with the delayer, and with prefill and decode apart."""
    if any(f.startswith("--disaggregation") for f in ctx.server_flags):
        raise ExperimentError("--disaggregation-* flags are chosen by the experiment itself (it starts a prefill "
                              "and a decode server); drop them from the command line")
    _, long, context, alone_steps, n = _sizes(ctx.quick)
    load = Load([None] * 64, [None], long, 10, 2 * n, alone_steps)
    flags = ("--max-running-requests", "80", "--max-total-tokens", str(24 * context), "--chunked-prefill-size",
             "1024", "--context-length", str(context))
    out = {}
    with ctx.server("dp=4", *flags) as url:
        out["colocated"] = asyncio.run(_measure(url, load, context))
    with ctx.server("dp=4", *flags, "--enable-prefill-delayer", label="delayer") as url:
        out["colocated, delayer"] = asyncio.run(_measure(url, load, context))
    bootstrap = free_port()
    log = ctx.output_dir / "logs" / f"{ctx.name}-router.log"
    pd = ("--disaggregation-timeout", "300")
    with ctx.server("dp=4", *flags, *pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                    str(bootstrap), label="prefill") as prefill, \
            ctx.server("dp=4", *flags, *pd, "--disaggregation-mode", "decode", label="decode") as decode:
        try:
            with router.launch_router(prefill, bootstrap, decode, Path(log)) as url:
                out["disaggregated"] = asyncio.run(_measure(url, load, context))
        except RuntimeError as e:
            raise ExperimentError(str(e)) from None
    summary = {k: {x: v for x, v in r.items() if x != "itl_series"} for k, r in out.items()}
    lost = {k: r["lost_pct"] for k, r in out.items()}
    result = {"decode_tokens_lost_pct": lost,
              "decoder_tok_s_during_prompts": {k: r["rate_prompts"] for k, r in out.items()},
              "prompt_ttft_s": {k: r["prompt_ttft_s"] for k, r in out.items()},
              "prompt_len": long, "tests": summary, "article": ARTICLE,
              "itl_series": {k: r["itl_series"][:: 1 + len(r["itl_series"]) // 1000] for k, r in out.items()}}
    co, de, dis = out["colocated"], out["colocated, delayer"], out["disaggregated"]
    table = [(f"decoder tokens lost to long prompts ({long} tokens here): colocated / delayer / apart",
              "38% / - / (none: \"the decode server never sees a prompt\")",
              f"{co['lost_pct']:.0f}% / {de['lost_pct']:.0f}% / {dis['lost_pct']:.0f}%"),
             ("decoder tok/s during prompts: colocated / delayer / apart", "1,270 / 1,610 / -",
              f"{co['rate_prompts']:.0f} / {de['rate_prompts']:.0f} / {dis['rate_prompts']:.0f}"),
             ("decoder tok/s alone: colocated / delayer / apart", "-",
              f"{co['rate_alone']:.0f} / {de['rate_alone']:.0f} / {dis['rate_alone']:.0f}"),
             ("a prompt's TTFT: colocated / delayer / apart (with the hand-off)", "0.30 / 0.65 s / -",
              f"{co['prompt_ttft_s']:.2f} / {de['prompt_ttft_s']:.2f} / {dis['prompt_ttft_s']:.2f} s")]
    notes = ("Apart: a prefill server and a decode server (dp=4 each) behind SGLang's router, on the same 2 CPU "
             "cores: the decode server never runs a prompt step, but the prefill server's work still takes the "
             "cores the decode server would use.")
    ctx.write(result, plot(out), table, notes)
    return result


def plot(out: dict[str, dict]):
    """The decoders' tokens per second and ITL over time, one column per test (a test's dict from `_measure`)."""
    fig, axes = figure(len(out), "prompt-in-the-way: the decoders' tokens per second (top) and every decoder "
                       "token's ITL (bottom) over time (Figure 8)", nrows=2)
    for rate_ax, itl_ax, (name, r) in zip(axes[:len(out)], axes[len(out):], out.items(), strict=True):
        t, gap = np.asarray(r["itl_series"]).T if r["itl_series"] else (np.zeros(0), np.zeros(0))
        # a stalled decoder sends no token, so the ITL plot alone shows a stall only where it ends; the rate
        # in bins of 0.25 s shows it as a drop to zero
        end = r["alone_s"] + r["prompts_s"]
        edges = np.arange(0.0, end + BIN_S, BIN_S)
        counts, _ = np.histogram(t, edges)
        rate_ax.stairs(counts / BIN_S, edges, fill=True, alpha=0.6)
        rate_ax.set_title(f"{name}: {r['lost_pct']:.0f}% fewer tokens", fontsize=9)
        itl_ax.scatter(t, gap * 1000, s=2, alpha=0.4)
        itl_ax.set_yscale("log")
        itl_ax.set_xlabel("s since the decoders alone")
        for ax in (rate_ax, itl_ax):
            ax.axvline(r["alone_s"], color="tab:red", lw=0.8, ls="--", label="prompts start")
            ax.set_xlim(0, end)
    axes[0].set_ylabel("decoder tokens / s")
    axes[len(out)].set_ylabel("ITL (ms)")
    axes[0].legend(fontsize=8)
    return fig


async def _measure(url: str, load: Load, context: int) -> dict:
    args = bench.parse_args(["--base-url", url, "--disable-tqdm"])
    rng = np.random.default_rng(0)
    max_new = context - 16 - 8  # decoders run until they are cancelled; bounded by the context
    if load.decode_steps() > max_new:
        raise ExperimentError(f"the load needs {load.decode_steps()} decode steps, more than the {max_new} tokens a "
                              f"decoder may produce in a context of {context}; raise the context or shorten the load")

    def request(n_in: int, n_out: int, rank: int | None) -> bench.Request:
        return bench.Request(rng.integers(1, 512, size=n_in).tolist(), n_in, n_out, rank)

    async def every_decoder_has(tokens: int, what: str) -> None:
        """Wait until each decoder has `tokens` tokens (a decoder gets one a decode step); one sentence if one
        stops or the wait passes 300 s."""
        t0 = time.perf_counter()
        while min(len(o.token_at) for o in dec) < tokens:
            if time.perf_counter() - t0 > 300 or any(t.done() for t in tasks):
                _cancel(tasks)
                await asyncio.gather(*tasks, return_exceptions=True)
                failed = [o.error for o in dec if o.error] + [repr(t.exception()) for t in tasks
                                                              if t.done() and not t.cancelled() and t.exception()]
                raise ExperimentError(f"the decoding requests did not all {what} within 300 s "
                                      f"({(failed or ['no error'])[0]})")
            await asyncio.sleep(0.02)

    args.timeout = 600.0
    async with bench.session(args) as client:
        dec = [bench.Outcome() for _ in load.decoder_ranks]
        tasks = [asyncio.create_task(bench.send(client, args, request(16, max_new, r), o))
                 for r, o in zip(load.decoder_ranks, dec, strict=True)]
        await every_decoder_has(2, "start")
        # settle (the last prompts read, the streams caught up), then the decoders alone: both in decode steps,
        # so the phases, like the prompts' interval, take the same share of the decoders' output at any step time
        await every_decoder_has(max(len(o.token_at) for o in dec) + SETTLE_STEPS, "settle into decoding")
        t_alone = time.perf_counter()
        await every_decoder_has(max(len(o.token_at) for o in dec) + load.alone_steps, "decode alone")
        t_prompts = time.perf_counter()
        alone = sum(np.count_nonzero(np.asarray(o.token_at) >= t_alone) for o in dec) / (t_prompts - t_alone)
        step_s = len(dec) / max(alone, 1e-9)  # a decoder gets one token per decode step
        interval_s = load.interval_steps * step_s
        prompts = []
        for k in range(load.num_prompts):
            o = bench.Outcome()
            rank = load.prompt_ranks[k % len(load.prompt_ranks)]
            prompts.append((o, asyncio.create_task(bench.send(client, args, request(load.prompt_len, 2, rank), o))))
            await asyncio.sleep(max(0.0, t_prompts + (k + 1) * interval_s - time.perf_counter()))
        t_end = time.perf_counter()
        done = [o.token_at[-1] for o, t in zip(dec, tasks, strict=True) if t.done() and o.token_at]
        t_end = min([t_end, *done])  # count only while every decoder still runs
        _cancel(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.wait([t for _, t in prompts], timeout=120)
    if t_end <= t_prompts:
        raise ExperimentError(f"a decoder ended {t_prompts - t_end:.2f} s before the prompts' phase ended, so "
                              "nothing measures the decoders while the prompts arrive; see the server's log")
    times = np.sort(np.concatenate([np.asarray(o.token_at[1:]) for o in dec]))
    rate_alone = np.count_nonzero((times >= t_alone) & (times < t_prompts)) / (t_prompts - t_alone)
    rate_prompts = np.count_nonzero((times >= t_prompts) & (times < t_end)) / (t_end - t_prompts)
    series = [(round(b - t_alone, 4), round(b - a, 5)) for o in dec for a, b in itertools.pairwise(o.token_at)
              if t_alone <= b < t_end]
    ok = [o for o, _ in prompts if o.ok]
    in_phase = [g for t, g in series if t >= t_prompts - t_alone]
    return {"rate_alone": rate_alone, "rate_prompts": rate_prompts,
            "lost_pct": 100.0 * (1.0 - rate_prompts / rate_alone) if rate_alone else 0.0,
            "prompts_sent": len(prompts), "prompts_done": len(ok),
            "prompt_ttft_s": statistics.median(o.ttft for o in ok) if ok else float("nan"),
            "median_itl_ms_alone": 1000 * statistics.median([g for t, g in series if t < t_prompts - t_alone] or [0]),
            "max_itl_ms_prompts": 1000 * max(in_phase or [0]),
            "alone_s": t_prompts - t_alone, "prompts_s": t_end - t_prompts, "decode_step_ms_alone": 1000 * step_s,
            "prompt_interval_s": interval_s, "itl_series": series}


def _cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
