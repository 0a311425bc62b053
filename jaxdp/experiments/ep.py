"""`ep` (the paragraph the article's section 9 left empty): the same loads with the MoE tensor-parallel
(`dp=4,moe=tp`) against expert-parallel (`dp=4,moe=ep`): the median time between two tokens, and the rows the
experts compute per step (jaxdp's accounting, `jaxdp.parallel.accounting.account_step`, whose counts the tests
check against the rows each expert receives), beside what SGLang's TP MoE would compute."""

from __future__ import annotations

from jaxdp.config import get_config
from jaxdp.experiments.runner import STEADY_NOTE, Context, context_for, figure, ms
from jaxdp.layout import parse_mesh_spec
from jaxdp.parallel.accounting import account_step

LOADS = {"one request": (1, 0, 0, 0), "balanced": (16, 16, 16, 16), "skewed": (40, 8, 8, 8)}
MESHES = {"moe=tp": "dp=4", "moe=ep": "dp=4,moe=ep"}


def run(ctx: Context) -> dict:
    input_len, output_len = (32, 64) if ctx.quick else (1024, 256)
    cfg = get_config(ctx.model_path)
    itl: dict[str, dict[str, float]] = {m: {} for m in MESHES}
    experts: dict[str, dict[str, dict]] = {m: {} for m in MESHES}
    for moe, mesh in MESHES.items():
        layout = parse_mesh_spec(mesh)
        with ctx.server(mesh, "--max-running-requests", "160", "--max-total-tokens",
                        str(2 * 40 * (input_len + output_len)), "--chunked-prefill-size", "1024",
                        "--context-length", str(context_for(input_len + output_len))) as url:
            for name, counts in LOADS.items():
                n = sum(counts)
                p = ctx.steady_gap_ms(url, num_prompts=n, input_len=input_len, output_len=output_len,
                                      ranks="skewed:" + ",".join(map(str, counts)))
                itl[moe][name] = p["gap_ms"]
                a = account_step(layout, cfg, counts, is_extend=False)
                experts[moe][name] = {"jaxdp_computed": a.experts_jaxdp.computed, "needed": a.experts_jaxdp.needed,
                                      "sglang_computed": a.experts_sglang.computed,
                                      "jaxdp_ratio": a.experts_jaxdp.ratio, "sglang_ratio": a.experts_sglang.ratio}
    result = {"median_itl_ms": itl, "itl_ratio_ep_over_tp": {k: itl["moe=ep"][k] / itl["moe=tp"][k] for k in LOADS},
              "expert_rows_per_step": experts, "loads": LOADS, "input_len": input_len, "output_len": output_len}
    fig, (left, right) = figure(2, "ep: the MoE tensor-parallel against expert-parallel on dp=4")
    x = range(len(LOADS))
    labels = [f"{k}\n{c}" for k, c in LOADS.items()]
    for off, moe, color in ((-0.2, "moe=tp", "tab:blue"), (0.2, "moe=ep", "tab:orange")):
        left.bar([i + off for i in x], [itl[moe][k] for k in LOADS], 0.4, label=moe, color=color)
        right.bar([i + off for i in x], [experts[moe][k]["sglang_ratio"] for k in LOADS], 0.4, color=color,
                  alpha=0.35, label=f"{moe}: SGLang computes")
        right.bar([i + off for i in x], [experts[moe][k]["jaxdp_ratio"] for k in LOADS], 0.4, color=color,
                  label=f"{moe}: jaxdp computes")
    left.set_xticks(list(x), labels)
    left.set_ylabel("ITL (ms), jaxdp")
    left.legend()
    right.set_xticks(list(x), labels)
    right.set_ylabel("expert rows computed / needed")
    right.legend(fontsize=7)
    table = []
    for k in LOADS:
        table.append((f"ITL {k} {LOADS[k]}: moe=tp / moe=ep", "(left empty)",
                      f"{ms(itl['moe=tp'][k])} / {ms(itl['moe=ep'][k])}"))
        e_tp, e_ep = experts["moe=tp"][k], experts["moe=ep"][k]
        table.append((f"expert rows computed {k}: SGLang tp / ep; jaxdp tp / ep (needed)",
                      f"{e_tp['sglang_computed']} / {e_ep['sglang_computed']}",
                      f"{e_tp['jaxdp_computed']} / {e_ep['jaxdp_computed']} ({e_tp['needed']})"))
    ctx.write(result, fig, table, notes="Expert rows are the rows one device's experts compute per layer and step "
              "(SGLang's column: what its MoE would compute for the same rows, the article's ratios). " + STEADY_NOTE)
    return result
