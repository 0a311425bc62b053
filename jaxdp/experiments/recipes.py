"""`recipes` (the article's section 10, last paragraph): the cookbook's two recipes, both with speculative decoding
(MTP). The low-latency one is tensor parallel and limits itself to 16 requests; the high-throughput one is DP
attention. Output tokens per second at 1, 16, 64 and 256 concurrent requests for tp=4 and dp=4, each with and
without `--speculative-algorithm EAGLE` (SGLang's DeepSeek defaults: 3 steps, topk 1, 4 draft tokens), on the
embedded default model (its MTP layer was trained with it) answering its long skill (`reverse S=` and `sort S=`
for S of 16 to 64 letters: answers the draft can predict, as a chat answer's continuation is for a real model);
the article's numbers beside.

The high-throughput recipe runs a third server, "mtp-off": MTP switched off above a batch size
(`--speculative-disable-by-batch-size N`, vLLM's), N measured in the same run: the largest concurrency at which MTP
was at least as fast as without it (1 if at none), so that many requests run as without speculation and few as
with it."""

from __future__ import annotations

import json

import numpy as np

from jaxdp.experiments.runner import Context, context_for, figure
from jaxdp.model.loader import default_model_path
from jaxdp.training.data import LONG, sample_problem

LAYOUTS = {"tp=4": "dp=1,tp=4", "dp=4": "dp=4"}
RECIPES = {"tp=4": "low-latency recipe", "dp=4": "high-throughput recipe"}
# the article (GLM-5.3 NVFP4, 4 x B300): output tok/s; "mtp" is the cookbook recipe, "plain" Figure 11's layout
ARTICLE_TOK_S = {"tp=4": {"mtp": {1: 318, 16: 1620}, "plain": {1: 157, 64: 2880, 256: 4680}},
                 "dp=4": {"mtp": {1: 152, 16: 1280, 256: 5780}, "plain": {1: 81, 64: 2500, 256: 6400}}}
COLORS = {"tp=4": "tab:blue", "dp=4": "tab:orange"}
OUTPUT_LEN = 72  # the longest answer (64 letters) and its end of sequence fit


def prompts_file(ctx: Context, n: int) -> tuple[object, float]:
    """A ShareGPT-format file of n held-out long-skill problems (half reverse, half sort); and the mean answer
    length in tokens (characters: the default model's tokenizer is byte-level)."""
    rng = np.random.default_rng(0)
    problems = [sample_problem(rng, LONG[i % len(LONG)], held_out=True) for i in range(n)]
    path = ctx.output_dir / "logs" / "recipes-prompts.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": p.prompt},
                                                   {"from": "gpt", "value": p.answer}]} for p in problems]))
    return path, float(np.mean([len(p.answer) for p in problems]))


def threshold(plain: dict[int, float], mtp: dict[int, float]) -> int:
    """--speculative-disable-by-batch-size from a run: the largest concurrency where MTP was at least as fast."""
    return max([c for c in plain if mtp[c] >= plain[c]], default=1)


def run(ctx: Context) -> dict:
    conc = [1, 4, 16] if ctx.quick else [1, 16, 64, 256]
    top = conc[-1]
    dataset, answer_len = prompts_file(ctx, 4 * top)
    curves: dict[str, dict[str, list[dict]]] = {}
    accept: dict[str, float] = {}
    off_above = 0

    def serve(name: str, mode: str, *extra: str) -> list[dict]:
        flags = ["--model-path", str(default_model_path()), "--max-running-requests", str(top),
                 "--max-total-tokens", str(2 * top * 256), "--chunked-prefill-size", "1024",
                 "--context-length", str(context_for(192)), *extra]
        points = []
        with ctx.server(LAYOUTS[name], *flags, label=mode, tokenizer=True) as url:
            for c in conc:
                p = ctx.bench(url, num_prompts=max(4, 2 * c), input_len=16, output_len=OUTPUT_LEN, concurrency=c,
                              dataset=dataset)
                points.append({"concurrency": c, "output_throughput": p["output_throughput"], "tpot_ms": p["tpot_ms"],
                               "ttft_ms": p["ttft_ms"]})
            if mode == "mtp":
                accept[name] = server_accept_length(url)
        return points

    def tok_of(points: list[dict]) -> dict[int, float]:
        return {p["concurrency"]: p["output_throughput"] for p in points}

    for name in LAYOUTS:
        curves[name] = {"plain": serve(name, "plain"), "mtp": serve(name, "mtp", "--speculative-algorithm", "EAGLE")}
        if name == "dp=4":  # the high-throughput recipe: speculation off above the batch size measured just now
            off_above = threshold(tok_of(curves[name]["plain"]), tok_of(curves[name]["mtp"]))
            curves[name]["mtp-off"] = serve(name, "mtp-off", "--speculative-algorithm", "EAGLE",
                                            "--speculative-disable-by-batch-size", str(off_above))
    tok = {k: {m: tok_of(v) for m, v in modes.items()} for k, modes in curves.items()}
    speedup = {k: {c: tok[k]["mtp"][c] / tok[k]["plain"][c] for c in conc} for k in LAYOUTS}
    off = {c: tok["dp=4"]["mtp-off"][c] / tok["dp=4"]["plain"][c] for c in conc}
    result = {"curves": curves, "mtp_speedup": speedup, "avg_spec_accept_length": accept,
              "disable_by_batch_size": off_above, "mtp_off_speedup": off,
              "article_tok_s": ARTICLE_TOK_S, "mean_answer_tokens": answer_len, "output_len": OUTPUT_LEN}
    table = []
    for c in conc:
        for k in LAYOUTS:
            art = ARTICLE_TOK_S[k]
            a = f"{art['mtp'].get(c, '-')} / {art['plain'].get(c, '-')}"
            table.append((f"{k} ({RECIPES[k]}) at {c}: tok/s with MTP / without", a,
                          f"{tok[k]['mtp'][c]:.0f} / {tok[k]['plain'][c]:.0f} (x{speedup[k][c]:.2f})"))
    table.append((f"dp=4 at {top}, MTP off above {off_above} requests (measured here): tok/s / without", "-",
                  f"{tok['dp=4']['mtp-off'][top]:.0f} / {tok['dp=4']['plain'][top]:.0f} (x{off[top]:.2f})"))
    table.append(("one request: MTP speedup, tp=4 / dp=4", f"{318 / 157:.2f} / {152 / 81:.2f}",
                  f"{speedup['tp=4'][1]:.2f} / {speedup['dp=4'][1]:.2f}"))
    table.append(("avg_spec_accept_length, tp=4 / dp=4 (3 steps)", "-",
                  f"{accept['tp=4']:.2f} / {accept['dp=4']:.2f}"))
    ctx.write(result, plot(curves), table,
              notes=f"The load: held-out long-skill problems (mean answer {answer_len:.0f} tokens), each request "
                    "stopping at its end of sequence. \"mtp-off\" (dp=4): --speculative-disable-by-batch-size "
                    f"{off_above}, the largest concurrency at which MTP was at least as fast as without it in this "
                    "run.")
    return result


def server_accept_length(url: str) -> float:
    """The server's avg_spec_accept_length (/get_server_info), the mean over ranks that verified."""
    import httpx

    return float(httpx.get(f"{url}/get_server_info", timeout=30).json().get("avg_spec_accept_length", 0.0))


def plot(curves):
    fig, (jx, art) = figure(2, "recipes: output tok/s with and without MTP speculative decoding")
    for name, modes in curves.items():
        for mode, pts in modes.items():
            jx.plot([p["concurrency"] for p in pts], [p["output_throughput"] for p in pts],
                    {"mtp": "o-", "plain": "s--"}.get(mode, "^:"), color=COLORS[name], label=f"{name}, {mode}")
    for name, modes in ARTICLE_TOK_S.items():
        for mode, pts in modes.items():
            art.plot(list(pts), list(pts.values()), "o-" if mode == "mtp" else "s--", color=COLORS[name],
                     label=f"{name}, {mode}")
    for ax, ylabel in ((jx, "output tok/s, jaxdp"), (art, "output tok/s, article (B300)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig
