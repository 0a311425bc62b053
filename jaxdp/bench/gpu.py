"""`python -m jaxdp.bench.gpu --deadline-s 500`: one GPU session's measurements in one command, within a deadline.

    python -m jaxdp.bench.gpu [--deadline-s 500] [--out DIR] [--rehearse] [--stages tests,trace,sweep]
                              [--write-winners] [--previous RUN.json] [--kernel-tests IDS]

Stages, in order of what they tell, each cut to its share of the time left (`SHARE`) and run in a
process of its own (a kernel that faults the GPU ends its stage, not the run):

- tests: the Pallas kernel tests compiled for the GPU (`JAXDP_PALLAS_INTERPRET=0`: Triton, not interpret mode)
  against their jnp references;
- trace: `jaxdp.bench.gpu_trace`: decode (batch 1, 32, 256) and prefill (32 x 64, 4 x 2,048 tokens) of DeepSeek-V3's
  first 5 layers in block FP8, each kernel's time, bytes, FLOPs and share of the bandwidth from `jax.profiler`, each
  model part and the step against the planner's floor;
- sweep: `jaxdp.bench.gpu_sweep`: every op's backends and its Pallas kernel's tile configurations, each beside
  its baseline; the fastest correct backend per op (geometric mean over the shapes measured) is this GPU kind's
  winner, merged into `jaxdp/ops/winners.json` under `device_kind` (what `jaxdp.ops.registry.choose` reads).

Whatever was measured when the deadline comes is written to `--out`: `gpu.json` (everything, no machine paths),
`gpu.md` (the tables docs/h200.md takes), `winners.json` (the merged table), `run.txt` (every stage's output).
Without a GPU it is a rehearsal (or with `--rehearse`): the same code at tiny shapes in interpret mode, said so on
its first line, its timings meaning nothing, and its winners written only to `--out` (`--write-winners`: into
`jaxdp/ops/winners.json` as well, which a GPU run does by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax

from jaxdp.bench.gpu_trace import CPU_TRACE_FLAG
from jaxdp.ops.registry import OPS, WINNERS

STAGES = ("tests", "trace", "sweep")
SHARE = {"tests": 0.2, "trace": 0.45, "sweep": 0.35}  # each stage's share of the time left to it and the later ones
KERNEL_TESTS = ("tests/test_kernels_mla.py", "tests/test_kernels_nvfp4.py", "tests/test_kernels_fp8.py",
                "tests/test_kernels_words.py")
REHEARSAL_TESTS = ("tests/test_kernels_mla.py::test_mla_decode_bf16_invalid_rows_and_odd_heads",)
MIN_STAGE_S = 10  # a stage is not started with less time than this left
CORRECT = 2e-2  # a candidate's largest difference from its baseline, relative to the baseline's largest value


def run_stage(cmd: list[str], env: dict, seconds: float, log) -> tuple[str, float]:
    """Run cmd for at most `seconds`, its output to stdout and `log`; ("exit N" or "cut at the deadline", seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def copy():
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        sys.stdout.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(seconds, 1))
        status = f"exit {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # its own session: the stage and whatever it started
        proc.wait()
        status = "cut at the deadline"
    reader.join(timeout=5)
    log.flush()
    return status, time.monotonic() - t0


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the deadline's kill
    return rows


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _correct(row: dict) -> bool:
    if row["error"] or not math.isfinite(row["us"]):
        return False
    diff, scale = row.get("max_abs_diff"), row.get("base_max_abs")
    if diff is None or not math.isfinite(diff):
        return True  # the baseline itself
    return diff <= CORRECT * max(scale or 0.0, 1.0)


def pick_winners(rows: list[dict], kind: str, key: str) -> dict[str, dict]:
    """Per op (backends) or kernel (tiles): the correct candidate with the lowest geometric mean of its time over
    the baseline's, among those measured on every shape the baseline was; with that mean and the shapes."""
    times: dict[str, dict[str, dict[str, float]]] = {}  # group -> case -> candidate -> us
    base: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("event") != "sweep" or r["kind"] != kind:
            continue
        if _correct(r):
            times.setdefault(r[key], {}).setdefault(r["case"], {})[r["candidate"]] = r["us"]
        if r.get("base_us") is not None and math.isfinite(r["base_us"]):
            base.setdefault(r[key], {})[r["case"]] = r["base_us"]
    out = {}
    for group, by_case in times.items():
        shapes = [c for c in by_case if c in base.get(group, {})]
        candidates = set.intersection(*(set(by_case[c]) for c in shapes)) if shapes else set()
        if not candidates or sum(len(by_case[c]) for c in shapes) <= len(shapes):
            continue  # nothing to choose between
        ratio = {n: _geomean([by_case[c][n] / base[group][c] for c in shapes]) for n in candidates}
        best = min(sorted(ratio), key=ratio.get)
        out[group] = dict(candidate=best, time_over_baseline=ratio[best], shapes=shapes)
    return out


def tile_winners(rows: list[dict]) -> dict[str, dict]:
    winners = pick_winners(rows, "tiles", "kernel")
    tiles = {(r["kernel"], r["candidate"]): r["tiles"] for r in rows if r.get("event") == "sweep"}
    return {k: dict(v, tiles=tiles[(k, v["candidate"])]) for k, v in winners.items()}


def merge_winners(path: Path, device_kind: str, backends: dict[str, dict]) -> dict:
    """The winners table at `path` with this device kind's measured ops replaced (other ops and kinds kept)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    mine = dict(table.get(device_kind, {}))
    mine.update({op: w["candidate"] for op, w in backends.items() if w["candidate"] in OPS[op].backends})
    if mine:
        table[device_kind] = dict(sorted(mine.items()))
    return table


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def markdown(report: dict, top: int = 12) -> str:
    """The run's tables, as docs/h200.md takes them."""
    lines = [f"Command: `{report['command']}`  ",
             f"Machine: {report['device_kind']} ({report['backend']}), jax {report['jax']}, python {report['python']}, "
             f"{report['date']}{' -- a CPU REHEARSAL: its timings mean nothing' if report['rehearsal'] else ''}  ",
             "Stages: " + "; ".join(f"{s['stage']} {s['status']} after {s['seconds']:.0f} s"
                                    for s in report["stages"]), ""]
    if report.get("kernel_tests"):
        lines += [f"Kernel tests ({'interpret mode' if report['rehearsal'] else 'compiled by Triton'}): "
                  f"{report['kernel_tests']}", ""]
    model = report.get("model")
    if model:
        m = model["machine"]
        lines += [f"Trace: {model['layers']} layers, hidden {model['hidden']}, {model['experts']} experts, "
                  f"{model['weights']} weights; floor at {m['read_GBps']:.0f} GB/s and {m['bf16_GFLOPs'] / 1e3:.0f} "
                  "bf16 TFLOP/s measured here", "",
                  "| step | time ms | floor ms | x the floor | floor reads | floor TFLOP | XLA's bytes | XLA's TFLOP "
                  "| traced ms |", "|---|---|---|---|---|---|---|---|---|"]
        for t in report["trace"]:
            lines.append(f"| {t['shape']} | {_ms(t['step_ms'])} | {_ms(t['floor_ms'])} | **{t['x_floor']:.1f}** | "
                         f"{_size(t['floor_bytes'])} | {t['floor_flops'] / 1e12:.3f} | {_size(t['xla_bytes'])} | "
                         f"{t['xla_flops'] / 1e12:.3f} | {_ms(t['traced_ms'])} |")
        for t in report["trace"]:
            lines += ["", f"{t['shape']}: by model part against its floor", "",
                      "| part | ms | floor ms | x its floor |", "|---|---|---|---|"]
            lines += [f"| {p['part']} | {_ms(p['ms'])} | {_ms(p['floor_ms'])} | "
                      f"{p['ms'] / p['floor_ms']:.1f} |" if p["floor_ms"] else
                      f"| {p['part']} | {_ms(p['ms'])} | (none) | |" for p in t["parts"]]
            lines += ["", f"{t['shape']}: the {top} longest kernels (bytes and FLOPs per step from the HLO; a custom "
                      "call, *, charged its whole operands)", "",
                      "| kernel | part | ms | calls | bytes | GFLOP | % of bandwidth |", "|---" * 7 + "|"]
            lines += [f"| {k['kernel']}{' *' if k['custom'] else ''} | {k['part']} | {_ms(k['ms'])} | "
                      f"{k['calls']:g} | {_size(k['bytes'])} | {k['flops'] / 1e9:.2f} | {100 * k['bw_share']:.1f} |"
                      for k in t["kernels"][:top]]
    sweep = report.get("sweep", [])
    if sweep:
        lines += ["", "Sweep (median us; x: the baseline's time over this one's; baseline: the op's xla backend, "
                  "for tiles the kernel's defaults; %BW of the bandwidth measured in the trace, when it ran)", "",
                  "| op | shape | kind | candidate | us | x | max diff | note |", "|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            speed = r["base_us"] / r["us"] if r.get("base_us") and math.isfinite(r["us"]) and r["us"] else math.nan
            note = r["error"] or ("" if _correct(r) else "differs from its baseline")
            lines.append(f"| {r['kernel']} | {r['case']} | {r['kind']} | {r['candidate']} | {r['us']:.1f} | "
                         f"{speed:.2f} | {r['max_abs_diff']:.1e} | {note} |")
    winners = report.get("winners", {})
    tiles = report.get("tile_winners", {})
    if winners or tiles:
        lines += ["", "Winners (geometric mean of the time over the baseline's, over the shapes measured)", "",
                  "| op or kernel | winner | time / baseline | shapes |", "|---|---|---|---|"]
        lines += [f"| {op} | {w['candidate']} | {w['time_over_baseline']:.2f} | {', '.join(w['shapes'])} |"
                  for op, w in {**winners, **tiles}.items()]
    if report.get("single_backend"):
        lines += ["", f"Not swept (one backend): {', '.join(report['single_backend'])}."]
    return "\n".join(lines) + "\n"


def recorded_args(argv: list[str] | None) -> list[str]:
    """The command's arguments as the output records them: without `--out`'s folder (a machine's path)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            kept.append(a)
    return kept


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline-s", type=float, default=500.0, help="everything written by then (seconds)")
    ap.add_argument("--out", default="gpu_run", help="folder for gpu.json, gpu.md, winners.json and run.txt")
    ap.add_argument("--rehearse", action="store_true", help="tiny shapes in interpret mode (automatic without a GPU)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"which of {', '.join(STAGES)}, comma-separated")
    ap.add_argument("--write-winners", action="store_true",
                    help="rehearsing, write the winners into jaxdp/ops/winners.json too (a GPU run always does)")
    ap.add_argument("--previous", help="an earlier run's gpu.json: its tile winners are tried early")
    ap.add_argument("--kernel-tests", help="the tests stage's pytest ids, space-separated (default: the kernel tests; "
                    "rehearsing, one of them)")
    ap.add_argument("--ops", help="the sweep's ops only, comma-separated (default: every op with a choice)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    if unknown := [s for s in stages if s not in STAGES]:
        print(f"error: --stages names {', '.join(unknown)}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if args.deadline_s <= 0:
        print("error: --deadline-s must be a positive number of seconds", file=sys.stderr)
        return 2
    end = time.monotonic() + args.deadline_s
    gpu = jax.default_backend() == "gpu"
    rehearsal = args.rehearse or not gpu
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "results.jsonl"
    jsonl.unlink(missing_ok=True)
    device_kind = jax.devices()[0].device_kind
    print(("REHEARSAL (no GPU: tiny shapes, interpret mode; its timings mean nothing): " if rehearsal else "GPU run: ")
          + f"{device_kind}, jax {jax.__version__}, deadline {args.deadline_s:.0f} s, stages {', '.join(stages)}",
          flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    if gpu:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    elif CPU_TRACE_FLAG not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {CPU_TRACE_FLAG}".strip()
    report = dict(command=" ".join(["python -m jaxdp.bench.gpu", *recorded_args(argv)]),
                  device_kind=device_kind, backend=jax.default_backend(), jax=jax.__version__,
                  python=platform.python_version(), rehearsal=rehearsal,
                  date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  deadline_s=args.deadline_s, stages=[])
    winners_path = WINNERS if gpu and not args.rehearse or args.write_winners else None
    py = sys.executable
    with open(out / "run.txt", "w") as log:
        for i, stage in enumerate(stages):
            left = end - time.monotonic() - 5  # (5 s to write the output)
            seconds = left * SHARE[stage] / sum(SHARE[s] for s in stages[i:])
            if seconds < MIN_STAGE_S:
                report["stages"].append(dict(stage=stage, status="skipped: no time left", seconds=0.0))
                print(f"== {stage}: skipped, no time left", flush=True)
                continue
            until = time.time() + seconds - min(30.0, 0.25 * seconds)  # no new item after this
            if stage == "tests":
                ids = args.kernel_tests.split() if args.kernel_tests else list(REHEARSAL_TESTS if rehearsal
                                                                               else KERNEL_TESTS)
                stage_env = dict(env, JAX_PLATFORMS="cpu" if rehearsal else "cuda")
                if not rehearsal:
                    stage_env["JAXDP_PALLAS_INTERPRET"] = "0"
                cmd = [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *ids]
            else:
                stage_env = env
                cmd = [py, "-m", f"jaxdp.bench.gpu_{stage}", "--jsonl", str(jsonl), "--until", f"{until:.0f}"]
                cmd += ["--rehearse"] if rehearsal else []
                if stage == "sweep":
                    cmd += (["--previous", args.previous] if args.previous else []) + (
                        ["--ops", args.ops] if args.ops else [])
            print(f"== {stage} (at most {seconds:.0f} s)", flush=True)
            log.write(f"== {stage}\n")
            status, took = run_stage(cmd, stage_env, seconds, log)
            report["stages"].append(dict(stage=stage, status=status, seconds=took))
            print(f"== {stage}: {status} after {took:.0f} s", flush=True)
            if stage == "tests":
                text = (out / "run.txt").read_text().split("== tests\n")[-1].strip().splitlines()
                report["kernel_tests"] = text[-1] if text else status
    write(report, read_jsonl(jsonl), out, winners_path)
    return 0


def write(report: dict, rows: list[dict], out: Path, winners_path: Path | None) -> None:
    """gpu.json, gpu.md and winners.json in `out` (and the winners into `winners_path`, when given)."""
    model = [r for r in rows if r.get("event") == "model"]
    report["model"] = model[-1] if model else None
    report["trace"] = [r for r in rows if r.get("event") == "trace"]
    report["sweep"] = [r for r in rows if r.get("event") == "sweep"]
    report["single_backend"] = next((r["ops"] for r in rows if r.get("event") == "single_backend"), [])
    report["winners"] = pick_winners(rows, "backend", "op")
    report["tile_winners"] = tile_winners(rows)
    table = merge_winners(winners_path or WINNERS, report["device_kind"], report["winners"])
    (out / "winners.json").write_text(json.dumps(table, indent=1) + "\n")
    if winners_path is not None:
        winners_path.write_text(json.dumps(table, indent=1) + "\n")
    (out / "gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "gpu.md").write_text(markdown(report))
    print(f"wrote {out / 'gpu.json'}, {out / 'gpu.md'}, {out / 'winners.json'}"
          + (f" and {winners_path}" if winners_path else ""), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
