"""`single-request` (the article's introduction and section 7): one request alone under tp=4, dp=4 and
dp=2,tp=2, and dp=4 with one request on each rank: the median time between two tokens. DP attention gives the
request one device for attention instead of four; an idle rank runs the step anyway, so filling it is cheap."""

from __future__ import annotations

from jaxdp.experiments.runner import GAP_NOTE, Context, context_for, figure, gap_ms, ms

LAYOUTS = {"tp=4": "dp=1,tp=4", "dp=4": "dp=4", "dp=2,tp=2": "dp=2,tp=2"}
ARTICLE_ITL_MS = {"tp=4": 6.6, "dp=4": 12.2, "dp=2,tp=2": 12.6, "dp=4, one per rank": 12.5}
ARTICLE_SINGLE_IN_SKEW_TEST_MS = 12.3  # the article's single request in the same test as the four (section 7)


def run(ctx: Context) -> dict:
    input_len, output_len, repeats = (16, 64, 3) if ctx.quick else (1024, 256, 5)
    pool = 4 * (input_len + output_len)
    itl, points = {}, {}
    for name, mesh in LAYOUTS.items():
        with ctx.server(mesh, "--max-running-requests", "16", "--max-total-tokens", str(pool),
                        "--cuda-graph-bs", "1", "2", "4", "--context-length",
                        str(context_for(input_len + output_len))) as url:
            p = ctx.bench(url, num_prompts=repeats, input_len=input_len, output_len=output_len, concurrency=1)
            itl[name], points[name] = gap_ms(p), p
            if name == "dp=4":  # the same server, one request on each rank at once
                p = ctx.bench(url, num_prompts=4 * repeats, input_len=input_len, output_len=output_len,
                              concurrency=4, ranks="0,1,2,3")
                itl["dp=4, one per rank"], points["dp=4, one per rank"] = gap_ms(p), p
    result = {"median_itl_ms": itl, "itl_ratio_dp_over_tp": itl["dp=4"] / itl["tp=4"],
              "itl_ratio_four_over_one_dp4": itl["dp=4, one per rank"] / itl["dp=4"],
              "requests_per_dp_rank": {k: p["requests_per_dp_rank"] for k, p in points.items()},
              "article_itl_ms": ARTICLE_ITL_MS, "input_len": input_len, "output_len": output_len}
    fig, (left, right) = figure(2, "single-request: one request (and one per rank) on 4 devices")
    names = list(itl)
    left.bar(names, [itl[k] for k in names], color="tab:blue")
    left.set_ylabel("ITL (ms), jaxdp")
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [ARTICLE_ITL_MS[k] / ARTICLE_ITL_MS["tp=4"] for k in names], 0.4,
              label="article (B300)", color="tab:gray")
    right.bar([i + 0.2 for i in x], [itl[k] / itl["tp=4"] for k in names], 0.4, label="jaxdp", color="tab:blue")
    right.set_xticks(list(x), names)
    right.set_ylabel("ITL over tp=4's ITL")
    right.axhline(1.0, color="k", lw=0.5)
    right.legend(loc="upper left", fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    table = [(f"ITL, {k}", ms(ARTICLE_ITL_MS[k]), ms(itl[k])) for k in names]
    table.append(("ITL ratio dp=4 / tp=4", f"{12.2 / 6.6:.2f}", f"{result['itl_ratio_dp_over_tp']:.2f}"))
    table.append(("dp=4: four requests (one per rank) / one", f"{12.5 / ARTICLE_SINGLE_IN_SKEW_TEST_MS:.2f} "
                  "(12.5 against 12.3 ms)", f"{result['itl_ratio_four_over_one_dp4']:.2f}"))
    ctx.write(result, fig, table, notes=GAP_NOTE)
    return result
