"""`crossover` (the article's section 10, Figure 11): output tokens per second and time per output token
against concurrency for tp=4, dp=4 and dp=2,tp=2, and the time to the first token under Poisson arrivals."""

from __future__ import annotations

from jaxdp.experiments.runner import Context, context_for, figure, ms

LAYOUTS = {"tp=4": "dp=1,tp=4", "dp=4": "dp=4", "dp=2,tp=2": "dp=2,tp=2"}
COLORS = {"tp=4": "tab:blue", "dp=4": "tab:orange", "dp=2,tp=2": "tab:green"}
# the article's Figure 11 (GLM-5.3 on 4 B300): output tok/s at 1, 64 and 256 concurrent requests; TPOT at 256
ARTICLE_TOK_S = {"tp=4": {1: 157, 64: 2880, 256: 4680}, "dp=4": {1: 81, 64: 2500, 256: 6400}}
ARTICLE_TPOT_256_MS = {"tp=4": 49, "dp=4": 35}
ARTICLE_TTFT_MS = {"tp=4": 47, "dp=4": 86}


def run(ctx: Context) -> dict:
    if ctx.quick:
        conc, input_len, output_len, rate, poisson_n = [1, 4, 16, 64], 32, 32, 4.0, 16
    else:
        conc, input_len, output_len, rate, poisson_n = [1, 2, 4, 8, 16, 32, 64, 128, 256], 256, 256, 4.0, 64
    top = conc[-1]
    curves: dict[str, list[dict]] = {}
    ttft: dict[str, float] = {}
    for name, mesh in LAYOUTS.items():
        with ctx.server(mesh, "--max-running-requests", str(top), "--max-total-tokens",
                        str(2 * top * (input_len + output_len)), "--chunked-prefill-size", "1024",
                        "--context-length", str(context_for(input_len + output_len))) as url:
            curves[name] = []
            for c in conc:
                p = ctx.bench(url, num_prompts=max(4, c if ctx.quick else 2 * c), input_len=input_len,
                              output_len=output_len, concurrency=c)
                curves[name].append({"concurrency": c, "output_throughput": p["output_throughput"],
                                     "tpot_ms": p["tpot_ms"], "itl_ms": p["itl_ms"], "ttft_ms": p["ttft_ms"]})
            p = ctx.bench(url, num_prompts=poisson_n, input_len=input_len, output_len=output_len, rate=rate)
            ttft[name] = p["ttft_ms"]["median"]
    tok = {k: {pt["concurrency"]: pt["output_throughput"] for pt in v} for k, v in curves.items()}
    result = {"curves": curves, "poisson_rate": rate, "median_ttft_ms_poisson": ttft,
              "dp_over_tp_throughput": {c: tok["dp=4"][c] / tok["tp=4"][c] for c in conc},
              "article_tok_s": ARTICLE_TOK_S, "article_tpot_256_ms": ARTICLE_TPOT_256_MS,
              "article_ttft_ms": ARTICLE_TTFT_MS, "input_len": input_len, "output_len": output_len}
    fig = plot(curves)
    table = []
    for c in conc:
        a = ARTICLE_TOK_S["tp=4"].get(c), ARTICLE_TOK_S["dp=4"].get(c)
        table.append((f"output tok/s at {c}: tp=4 / dp=4 / dp=2,tp=2", f"{a[0]} / {a[1]}" if a[0] else "-",
                      " / ".join(f"{tok[k][c]:.0f}" for k in LAYOUTS)))
    last = {k: curves[k][-1]["tpot_ms"]["median"] for k in LAYOUTS}
    table.append((f"median TPOT at {top}: tp=4 / dp=4 / dp=2,tp=2", "49 / 35 ms (at 256)",
                  " / ".join(ms(last[k]) for k in LAYOUTS)))
    table.append((f"median TTFT, Poisson {rate:g}/s: tp=4 / dp=4 / dp=2,tp=2", "47 / 86 ms",
                  " / ".join(ms(ttft[k]) for k in LAYOUTS)))
    ctx.write(result, fig, table)
    return result


def plot(curves: dict[str, list[dict]]):
    """Throughput and TPOT against concurrency (a layout's points as in the JSON's `curves`), beside the article's."""
    fig, (thr, tpot, art) = figure(3, "crossover: output throughput and TPOT against concurrency (Figure 11)")
    for name, pts in curves.items():
        xs = [p["concurrency"] for p in pts]
        thr.plot(xs, [p["output_throughput"] for p in pts], "o-", color=COLORS[name], label=name)
        tpot.plot(xs, [p["tpot_ms"]["median"] for p in pts], "s--", color=COLORS[name], label=name)
    for name, pts in ARTICLE_TOK_S.items():
        art.plot(list(pts), list(pts.values()), "o-", color=COLORS[name], label=name)
    # TPOT and the article's throughput span two orders of magnitude: on a linear axis their low end is flat
    for ax, ylabel, yscale in ((thr, "output tok/s, jaxdp", "linear"), (tpot, "median TPOT (ms), jaxdp", "log"),
                               (art, "output tok/s, article (B300)", "log")):
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    return fig
