"""`skew` (the article's section 5.1): 64 decoding requests pinned (16,16,16,16), (40,8,8,8) and (64,0,0,0) on
dp=4; the median time between two tokens of a request in each. Every rank runs the busiest rank's bucket, so
the same work costs more when it is unevenly spread."""

from __future__ import annotations

import statistics

from jaxdp.experiments.runner import STEADY_NOTE, Context, context_for, figure, ms

PATTERNS = {"balanced": (16, 16, 16, 16), "skewed": (40, 8, 8, 8), "one rank": (64, 0, 0, 0)}
ARTICLE_ITL_MS = {"balanced": 24.9, "skewed": 29.0, "one rank": 30.7}


def run(ctx: Context) -> dict:
    input_len, output_len, runs = (32, 64, 1) if ctx.quick else (1024, 256, 3)
    n = sum(PATTERNS["balanced"])
    pool = 2 * n * (input_len + output_len)  # every request on one rank, with room for the reservation
    itl: dict[str, list[float]] = {k: [] for k in PATTERNS}
    points = {}
    with ctx.server("dp=4", "--max-running-requests", str(4 * n), "--max-total-tokens", str(pool),
                    "--chunked-prefill-size", "1024",
                    "--context-length", str(context_for(input_len + output_len))) as url:
        for _ in range(runs):  # interleaved, so a slow spell of a shared machine spreads over all three
            for name, counts in PATTERNS.items():
                p = ctx.steady_gap_ms(url, num_prompts=n, input_len=input_len, output_len=output_len,
                                      ranks="skewed:" + ",".join(map(str, counts)))
                itl[name].append(p["gap_ms"])
                points[name] = p
    median = {k: statistics.mean(v) for k, v in itl.items()}
    ratio = median["skewed"] / median["balanced"]
    result = {"median_itl_ms": median, "median_itl_ms_runs": itl, "itl_ratio_skewed_over_balanced": ratio,
              "itl_ratio_one_rank_over_balanced": median["one rank"] / median["balanced"],
              "steady": points,
              "article_itl_ms": ARTICLE_ITL_MS, "input_len": input_len, "output_len": output_len, "runs": runs}
    fig, (left, right) = figure(2, "skew: 64 decoding requests on dp=4")
    names = list(PATTERNS)
    labels = [f"{k}\n{PATTERNS[k]}" for k in names]
    left.bar(labels, [median[k] for k in names], color="tab:blue")
    left.set_ylabel("ITL (ms), jaxdp")
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [ARTICLE_ITL_MS[k] / ARTICLE_ITL_MS["balanced"] for k in names], 0.4,
              label="article (B300)", color="tab:gray")
    right.bar([i + 0.2 for i in x], [median[k] / median["balanced"] for k in names], 0.4, label="jaxdp",
              color="tab:blue")
    right.set_xticks(list(x), labels)
    right.set_ylabel("ITL over the balanced ITL")
    right.axhline(1.0, color="k", lw=0.5)
    right.legend(loc="upper left", fontsize=8)
    table = [(f"ITL {k} {PATTERNS[k]}", ms(ARTICLE_ITL_MS[k]), ms(median[k])) for k in names]
    table.append(("ITL ratio skewed / balanced", "1.17", f"{ratio:.2f}"))
    table.append(("ITL ratio one rank / balanced", "1.23", f"{result['itl_ratio_one_rank_over_balanced']:.2f}"))
    ctx.write(result, fig, table, notes=STEADY_NOTE)
    return result
