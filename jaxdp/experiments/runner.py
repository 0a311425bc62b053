"""What every experiment shares: its own servers on 127.0.0.1, `jaxdp.bench` as the load, and the outputs
(`NAME.json`, `NAME.png`, `NAME.md`: the article's figures beside jaxdp's)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from jaxdp.bench import serving as bench
from jaxdp.bench.launch import NotReady, stop, wait_healthy
from jaxdp.net import free_port
from jaxdp.serve import build_parser

# what the experiments choose themselves; a user flag for one of these would silently fight them
OWNED_FLAGS = ("--mesh", "--host", "--port", "--tp-size", "--tp", "--attn-dp-size", "--dp-size", "--dp",
               "--enable-dp-attention", "--moe-a2a-backend", "--enable-prefill-delayer", "--nnodes", "--node-rank",
               "--dist-init-addr")
# small pools and the tiny preset unless the user says otherwise (any later flag of the same name wins)
DEFAULT_SERVER_FLAGS = ["--model-path", "tiny", "--skip-tokenizer-init", "--page-size", "16",
                        "--decode-log-interval", "1000", "--log-level", "warning"]


class ExperimentError(Exception):
    """A user-facing failure: printed as one `error: ...` line, exit status 2."""


def check_server_flags(flags: list[str]) -> None:
    """Refuse flags the experiments set themselves, and flags `jaxdp.serve` does not know, in one sentence."""
    for f in flags:
        name = f.split("=", 1)[0]
        if name in OWNED_FLAGS:
            raise ExperimentError(f"{name} is chosen by the experiment itself (it starts each layout it needs); "
                                  f"drop it from the command line")
    _, unknown = build_parser().parse_known_args(flags)
    if unknown:
        raise ExperimentError(f"{unknown[0]!r} is not a flag of python -m jaxdp.serve; see its --help")


@dataclasses.dataclass
class Context:
    """One experiment's run: quick or full, where it writes (the table and plot to output_dir, the raw JSON to
    json_dir, the same folder unless given), and the user's server flags."""

    name: str
    quick: bool
    output_dir: Path
    server_flags: list[str] = dataclasses.field(default_factory=list)
    start_timeout_s: float = 600.0
    json_dir: Path | None = None

    @property
    def json_path(self) -> Path:
        return (self.json_dir or self.output_dir) / f"{self.name}.json"

    @property
    def model_path(self) -> str:
        flags = DEFAULT_SERVER_FLAGS + self.server_flags
        return [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--model-path"][-1]

    @contextlib.contextmanager
    def server(self, mesh: str, *flags: str, label: str = "", tokenizer: bool = False) -> Iterator[str]:
        """`python -m jaxdp.serve --mesh MESH` on a free port of 127.0.0.1 for the `with` block; yields its URL.
        The experiment's own sizes come before the user's flags, so a user flag wins. `tokenizer`: the server
        reads text (the default flags skip its tokenizer: the loads are token ids)."""
        port = free_port()
        tag = mesh.replace(",", "_").replace("=", "") + (f"-{label}" if label else "")
        log_path = self.output_dir / "logs" / f"{self.name}-{tag}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        defaults = [f for f in DEFAULT_SERVER_FLAGS if not (tokenizer and f == "--skip-tokenizer-init")]
        cmd = [sys.executable, "-m", "jaxdp.serve", *defaults, *flags, *self.server_flags,
               "--mesh", mesh, "--host", "127.0.0.1", "--port", str(port)]
        print(f"[{self.name}] starting a server: --mesh {mesh} {' '.join(flags)} (log: {log_path})", flush=True)
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(proc, url, log_path, self.start_timeout_s)
            except NotReady as e:
                raise ExperimentError(str(e)) from None
            yield url
        finally:
            stop(proc)

    def bench(self, url: str, *, num_prompts: int, input_len: int, output_len: int, concurrency: int | None = None,
              ranks: str = "none", rate: float | None = None, warmup: int = 1, seed: int = 1,
              dataset: Path | None = None) -> dict:
        """One `jaxdp.bench` point against `url`: random token ids, or the conversations of a ShareGPT-format
        `dataset` (text; each request stops at its end of sequence, at most `output_len` tokens)."""
        argv = ["--base-url", url, "--num-prompts", str(num_prompts), "--random-input-len", str(input_len),
                "--random-output-len", str(output_len), "--routed-dp-rank", ranks, "--warmup-requests", str(warmup),
                "--seed", str(seed), "--disable-tqdm"]
        if dataset is not None:
            argv += ["--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len",
                     str(output_len), "--disable-ignore-eos"]
        if concurrency is not None:
            argv += ["--max-concurrency", str(concurrency)]
        if rate is not None:
            argv += ["--request-rate", str(rate)]
        try:
            return bench.run(bench.parse_args(argv))[0]
        except bench.BenchError as e:
            raise ExperimentError(f"the load against {url} failed: {e}") from None

    def steady_gap_ms(self, url: str, *, num_prompts: int, input_len: int, output_len: int, ranks: str) -> dict:
        """All requests at once; the time between two tokens of a request in the steady state: from the moment
        every request has its first token (all prompts read) until the first one finishes, that window's
        length over the tokens a request got in it. The article's requests decode with nothing else going on."""
        argv = ["--base-url", url, "--num-prompts", str(num_prompts), "--random-input-len", str(input_len),
                "--random-output-len", str(output_len), "--routed-dp-rank", ranks, "--disable-tqdm"]
        args = bench.parse_args(argv)
        reqs = bench.random_requests(args, np.random.default_rng(args.seed))
        for req, rank in zip(reqs, bench.rank_pattern(ranks, len(reqs)), strict=True):
            req.rank = rank

        async def drive() -> list[bench.Outcome]:
            async with bench.session(args) as client:
                return await asyncio.gather(*(bench.send(client, args, r) for r in reqs))

        outs = asyncio.run(drive())
        if bad := [o.error for o in outs if not o.ok]:
            raise ExperimentError(f"the load against {url} failed: {bad[0]}")
        start, end = max(o.token_at[0] for o in outs), min(o.token_at[-1] for o in outs)
        tokens = sum(int(np.count_nonzero((np.asarray(o.token_at) > start) & (np.asarray(o.token_at) <= end)))
                     for o in outs)
        if end <= start or tokens == 0:
            raise ExperimentError("no steady window: the first request finished before the last one started "
                                  "decoding; raise the output length")
        return {"gap_ms": 1000 * (end - start) * len(outs) / tokens, "window_s": end - start,
                "tokens_in_window": tokens,
                "requests_per_dp_rank": dict(Counter(str(o.dp_rank) for o in outs if o.dp_rank is not None))}

    def write(self, result: dict, fig, table: list[tuple[str, str, str]], notes: str = "") -> list[Path]:
        """NAME.json (with the config), NAME.png, NAME.md (a table: quantity | article | jaxdp)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        base = self.output_dir / self.name
        result = {"experiment": self.name, "quick": self.quick, "server_flags": self.server_flags,
                  "machine": machine(), **result}
        self.json_path.write_text(json.dumps(result, indent=2) + "\n")
        fig.savefig(f"{base}.png", dpi=110)
        lines = [f"### {self.name}{' (--quick)' if self.quick else ''}", "",
                 "| quantity | article (4x B300, GLM-5.3) | jaxdp (this run) |", "| --- | --- | --- |"]
        lines += [f"| {q} | {a} | {j} |" for q, a, j in table]
        if notes:
            lines += ["", notes]
        Path(f"{base}.md").write_text("\n".join(lines) + "\n")
        return [self.json_path, Path(f"{base}.png"), Path(f"{base}.md")]


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores, {cpu}"


def figure(ncols: int, title: str, nrows: int = 1):
    """A figure of nrows x ncols plots; the axes row by row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.0 * nrows), layout="constrained", squeeze=False)
    fig.suptitle(title)
    return fig, list(axes.flat)


def context_for(tokens: int, page: int = 64) -> int:
    """The --context-length a load needs (rounded up): the compiled steps' attention spans the whole context,
    so a server sized for its load, not the model's maximum, keeps memory and step time down."""
    return -(-(tokens + 8) // page) * page


STEADY_NOTE = ("ITL here is the time between two tokens of a request while all of them decode (from the "
               "last first token to the first finish), so the prompts' steps do not count.")
GAP_NOTE = ("ITL here is the median over requests of each request's mean time between two tokens (TPOT); the "
            "article's is the mean time between two tokens.")


def gap_ms(point: dict) -> float:
    """The time between two tokens of a request, as the median over requests of each one's mean gap (TPOT).
    Not the median of single gaps: on a loaded CPU the server's event loop can deliver two tokens back to back,
    which splits one long gap into a long and a near-zero one."""
    return point["tpot_ms"]["median"]


def ms(value: float) -> str:
    return f"{value:.1f} ms"


def write_rows(path: str, rows: list[dict]) -> None:
    """An experiment script's raw rows as JSON at `path` (its folder made), and a line saying where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {path}")
