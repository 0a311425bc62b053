"""Text and figure for `python -m jaxdp.plan`: reads the plan dict that jaxdp.plan builds."""

from __future__ import annotations

from typing import Any

from jaxdp.planner.roofline import ARTICLE_EXPERT_GEMM_EXTRA_MS, ARTICLE_MS, ARTICLE_NON_EXPERT_GEMM_EXTRA_MS

GiB = 2**30


class PlotError(RuntimeError):
    """`--plot` cannot draw here (its library is missing); the message says what to install."""

ASSUMPTIONS = [
    "weights: SGLang's placement for the DeepSeek-V3 family (docs/plan.md); routed experts in "
    "--expert-dtype (fp8: a block-FP8 checkpoint, its attention, shared expert and dense layers FP8 too), "
    "every other weight bf16; the MTP (next-token) layer is not loaded",
    "KV budget per GPU = mem-fraction-static x memory - weights (SGLang's rule, without its activation "
    "reserve); --match-tp-tokens sets the budget at which TP holds that many tokens",
    "KV per token per layer: the MLA latent (kv_lora_rank + rope) in --kv-dtype, plus for DSA models the "
    "indexer key (bf16; with --kv-dtype fp8, fp8 with one fp32 scale per 128 values, SGLang's 132 bytes)",
    "buckets: SGLang's defaults, 52 decode sizes up to 512 rows and 42 prompt sizes up to 2,048 rows",
    "collective bytes: the buffer on one device (the article's convention); roofline: ring algorithms, "
    "bytes sent / link bandwidth + a fixed latency per call; the CPU agreement is not timed",
    "roofline: one term per component, max(bytes / HBM bandwidth, FLOPs / peak), no overlap, peak figures; "
    "a floor, not a prediction; routed experts read = experts picked under uniform routing",
]

ARTICLE_WEIGHTS_GIB = {"tp": 106.6, "dp": 125.7}
ARTICLE_TOKENS = {"tp": 2.68e6, "dp": 2.25e6, "dp_total": 9.0e6}


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _err(estimate: float, measured: float) -> str:
    return f"{(estimate / measured - 1) * 100:+.1f}%"


def is_article_setting(plan: dict[str, Any]) -> bool:
    """GLM-5(.3) with NVFP4 experts, attention DP on 4 B300s: the setting the article measured."""
    c = plan["config"]
    lay = plan["plan"]["layout"]
    return (c["num_layers"] == 78 and c["hidden"] == 6144 and c["vocab"] == 154880 and plan["gpus"] == 4
            and plan["gpu"]["name"] == "B300" and plan["expert_dtype"] == "nvfp4" and lay["dp"] == 4
            and lay["moe"] == "tp" and plan["placement"] == "sglang")


def _lbl(layout: dict[str, Any]) -> str:
    return f"dp={layout['dp']},tp={layout['tp']}" + (",ep" if layout["moe"] == "ep" else "")


def format_report(plan: dict[str, Any]) -> str:
    main, tp = plan["plan"], plan["tp"]
    g, c = plan["gpu"], plan["config"]
    article = is_article_setting(plan)
    out = [f"jaxdp plan: {plan['model']} ({c['model_type']}, {c['num_layers']} layers, hidden {c['hidden']}, "
           f"vocab {c['vocab']:,}) on {plan['gpus']} x {g['name']} ({g['memory_gib']:g} GiB, "
           f"{g['hbm_tbs']:g} TB/s, {g['bf16_tflops']:g} TFLOP/s bf16, link {g['link_gbs']:g} GB/s)",
           f"layout: {main['describe']}" + ("   beside: tensor parallelism over the same GPUs" if tp else ""),
           f"{plan['placement']} placement, experts {plan['expert_dtype']}, KV {plan['kv_dtype']}; budget "
           f"{plan['budget_gib']:.1f} GiB per GPU (mem-fraction-static {plan['mem_fraction_static']:.3f})",
           ""]
    a, b = _lbl(main["layout"]), _lbl(tp["layout"]) if tp else ""
    out.append(f"Weights per GPU, GiB     {a:>10} {b:>10}   placement under {a}")
    tpw = {w["name"]: w for w in tp["weights"]} if tp else {}
    for w in main["weights"]:
        other = f"{tpw[w['name']]['bytes_per_device'] / GiB:10.2f}" if w["name"] in tpw else " " * 10
        out.append(f"  {w['name']:<29}{w['bytes_per_device'] / GiB:7.2f} {other}   {w['placement']}")
    tot_b = f"{tp['weights_per_device_gib']:10.2f}" if tp else ""
    out.append(f"  {'total':<29}{main['weights_per_device_gib']:7.2f} {tot_b}")
    if article and tp:
        dp_w, tp_w = main["weights_per_device_gib"], tp["weights_per_device_gib"]
        aw = ARTICLE_WEIGHTS_GIB
        out.append(f"  {'article (measured)':<29}{aw['dp']:7.1f} {aw['tp']:10.1f}   error "
                   f"{_err(dp_w, aw['dp'])} / {_err(tp_w, aw['tp'])}; difference {dp_w - tp_w:.2f} GiB "
                   f"(article {aw['dp'] - aw['tp']:.1f})")
    kb = plan["kv_bytes"]
    per_rank, total = main["kv_tokens_per_rank"], main["kv_tokens_total"]
    out += ["", f"KV cache: ({kb['latent']} B latent + {kb['indexer']} B index key) x {kb['layers']} layers "
            f"= {plan['kv_bytes_per_token']:,} B per token",
            f"  tokens per attention group {per_rank:>12,}" +
            (f"   TP: {tp['kv_tokens_per_rank']:,} on every GPU" if tp else ""),
            f"  tokens in total            {total:>12,}" +
            (f"   TP: {tp['kv_tokens_total']:,} ({total / max(tp['kv_tokens_total'], 1):.1f}x)"
             if tp else "")]
    if d := main.get("dcp"):
        out.append(f"  decode context parallelism --dcp-size {d['size']}: each GPU holds 1/{d['size']} of every "
                   f"sequence, {d['tokens_per_device']:,} tokens per GPU, {d['tokens_per_group']:,} per group; a "
                   f"decode step of {d['decode_rows']:,} rows a group adds " + "; ".join(
                       f"{x['name']} {x['op']} {fmt_bytes(x['buffer_bytes'])} x {x['calls']}"
                       for x in d["collectives"]) + f" ({fmt_bytes(d['bytes_per_step'])} a step)")
    ho = plan["handoff"]
    out.append(f"  prefill/decode hand-off at {ho['link_gbs']:g} GB/s: " + "; ".join(
        f"{p['tokens']:,} tokens {fmt_bytes(p['bytes'])} in {p['ms']:.1f} ms" for p in ho["prompts"]))
    if article and tp:
        at = ARTICLE_TOKENS
        out.append(f"  article: {at['dp'] / 1e6:.2f} M per GPU, {at['dp_total'] / 1e6:.1f} M in total, "
                   f"TP {at['tp'] / 1e6:.2f} M; error {_err(per_rank, at['dp'])} / "
                   f"{_err(total, at['dp_total'])}")
    width = max(20, *(len(",".join(map(str, s["rows"]))) + 2 for s in main["situations"].values()))
    out += ["", f"Situations under {a} (a row is {plan['row_bytes']:,} B; bytes = the buffer on one device; "
            "ratios = rows computed / rows needed, SGLang / jaxdp)",
            f"  {'situation':<13}{'rows':<{width}}{'mode':<9}{'bucket':>6} {'gathered':>20} {'padded':>20}"
            f" {'per step':>10}  {'attention':>11}  {'experts':>11}  LM head"]
    for name, s in main["situations"].items():
        rows = ",".join(str(r) for r in s["rows"])
        gathered = f"{s['gathered_rows']:,} ({fmt_bytes(s['gathered_bytes'])})"
        padded = f"{s['padded_rows']:,} ({fmt_bytes(s['padded_bytes'])})"
        bucket = str(s["bucket"] or "-")
        out.append(f"  {name:<13}{rows:<{width}}{s['gather_mode']:<9}{bucket:>6} {gathered:>20} {padded:>20}"
                   f" {fmt_bytes(s['bytes_per_step']):>10}  "
                   f"{s['attention_sglang']['ratio']:5.2f}/{s['attention_jaxdp']['ratio']:<5.2f}  "
                   f"{s['experts_sglang']['ratio']:5.2f}/{s['experts_jaxdp']['ratio']:<5.2f}  "
                   f"{s['lm_head']['ratio']:4.2f} ({s['lm_head_form']})")
    first = next(iter(main["situations"]))
    out.append(f"  collectives in '{first}': " + "; ".join(
        f"{x['name']} {x['op']} over {x['group']}: {fmt_bytes(x['buffer_bytes'])} x {x['calls']}"
        for x in main["situations"][first]["collectives"]))
    assumptions = plan.get("assumptions", ASSUMPTIONS)
    out += ["", *_roofline_lines(plan, article), "", "Assumptions:", *[f"  - {x}" for x in assumptions]]
    return "\n".join(out)


def _roofline_lines(plan: dict[str, Any], article: bool) -> list[str]:
    main, tp = plan["plan"], plan["tp"]
    out = [f"Roofline of one decode step on the busiest GPU, ms ({plan['gpu']['name']}, {plan['context']:,} "
           f"tokens of context per request, {plan['latency_us']:g} us per collective call)"]
    for case, title in (("single", "one request"), ("batch", "batch " + ",".join(
            str(r) for r in main["roofline"]["batch"]["sglang"]["rows"]))):
        cols = ([("TP", tp["roofline"][case]["sglang"])] if tp else []) + [
            ("SGLang", main["roofline"][case]["sglang"]), ("jaxdp", main["roofline"][case]["jaxdp"])]
        out.append(f"  {title:<28}" + "".join(f"{n:>10}" for n, _ in cols))
        for i, t in enumerate(cols[0][1]["terms"]):
            out.append(f"    {t['name']:<26}" + "".join(f"{r['terms'][i]['ms']:10.3f}" for _, r in cols))
        out.append(f"    {'total':<26}" + "".join(f"{r['ms']:10.2f}" for _, r in cols))
        if not (article and tp and case == "single"):
            continue
        est_tp, est_dp = cols[0][1]["ms"], cols[1][1]["ms"]
        m_tp, m_dp = ARTICLE_MS[("tp", "single")], ARTICLE_MS[("dp", "single")]
        out.append(f"    {'article (measured)':<26}{m_tp:10.1f}{m_dp:10.1f}")
        out.append(f"    {'error':<26}{_err(est_tp, m_tp):>10}{_err(est_dp, m_dp):>10}")
        diffs = {t["name"]: cols[1][1]["terms"][i]["ms"] - t["ms"] for i, t in enumerate(cols[0][1]["terms"])}
        top = sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
        out.append(f"    DP - TP: {est_dp - est_tp:.2f} ms estimated, {m_dp - m_tp:.1f} ms measured; largest "
                   "parts: " + ", ".join(f"{k} {v:+.2f}" for k, v in top))
        attn_dp = cols[1][1]["terms"][0]["ms"]
        out.append(f"    one GPU reading all attention weights under DP: {attn_dp:.2f} ms (the article: the "
                   f"non-expert GEMMs take {ARTICLE_NON_EXPERT_GEMM_EXTRA_MS} ms more; "
                   f"{_err(attn_dp, ARTICLE_NON_EXPERT_GEMM_EXTRA_MS)}); extra over TP "
                   f"{diffs['attention projections']:.2f} ms ({_err(diffs['attention projections'], 3.3)})")
        pad = diffs["routed experts"]
        out.append(f"    padding rows in the experts (SGLang): {pad:+.2f} ms (the article: the expert "
                   f"GEMMs take {ARTICLE_EXPERT_GEMM_EXTRA_MS} ms more; "
                   f"{_err(pad, ARTICLE_EXPERT_GEMM_EXTRA_MS)}); jaxdp masks them: "
                   f"{cols[2][1]['ms']:.2f} ms in total")
    if article and tp:
        bal = main["roofline"]["batch"]
        if bal["sglang"]["rows"] == [16, 16, 16, 16]:
            m = ARTICLE_MS[("dp", "balanced")]
            out.append(f"    article (measured), DP balanced: {m} ms; error {_err(bal['sglang']['ms'], m)}")
    return out


def plot_situations(plan: dict[str, Any], path: str) -> None:
    """Rows per rank, padding and the experts' ratio for each situation (the article's Figures 5, 13). matplotlib
    is the benchmarks' dependency, not the planner's: without it, PlotError."""
    try:  # (optional: imported only to draw)
        import matplotlib
    except ImportError:
        raise PlotError('--plot needs matplotlib: pip install "jaxdp[bench]" (or matplotlib), or leave --plot out.'
                        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sits = plan["plan"]["situations"]
    fig, axes = plt.subplots(1, len(sits), figsize=(3.2 * len(sits), 3.4), squeeze=False)
    for ax, (name, s) in zip(axes[0], sits.items(), strict=True):
        ranks = range(len(s["rows"]))
        pad_to = s["bucket"] if s["gather_mode"] == "max_len" and s["bucket"] else None
        ax.bar(ranks, s["rows"], color="#3b75af", label="rows needed")
        if pad_to:
            ax.bar(ranks, [pad_to - r for r in s["rows"]], bottom=s["rows"], color="#d9d9d9",
                   hatch="//", edgecolor="#888888", label="padding")
        ax.set_title(f"{name}\n{s['gather_mode']}, experts x{s['experts_sglang']['ratio']:.2f} (SGLang)"
                     f"\nx{s['experts_jaxdp']['ratio']:.0f} (jaxdp)", fontsize=9)
        ax.set_xticks(list(ranks))
        ax.set_xlabel(f"rank  (gathered {s['gathered_rows']:,} rows for {s['exact_rows']:,})", fontsize=8)
    axes[0][0].set_ylabel("rows in the step")
    handles, labels = axes[0][1 if len(sits) > 1 else 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.suptitle(f"{plan['model']}: {plan['plan']['describe']}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
