"""`python -m jaxdp.bench` against a live `jaxdp.serve --mesh dp=8` (tiny model, no tokenizer) on 8 CPU devices:
a concurrency sweep writes its JSON and PNG, a skewed `--routed-dp-rank` pattern lands on the ranks it names
(checked on the server's /metrics), and an unreachable server is one `error:` line with exit status 2. One
server for the module, always stopped."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from servers import Server, free_port

from jaxdp.bench.serving import main, rank_pattern

SMALL = ["--chunked-prefill-size", "64", "--max-running-requests", "32", "--cuda-graph-bs", "4",
         "--decode-log-interval", "50", "--page-size", "16", "--max-total-tokens", "512"]
RUN = ["--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(["--mesh", "dp=8", "--model-path", "tiny", "--skip-tokenizer-init", *SMALL],
                    tmp_path_factory.mktemp("bench") / "server.log")
    try:
        yield server.wait().url
    finally:
        server.stop()


def finished_per_rank(url: str) -> dict[int, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {int(r): float(v) for r, v in re.findall(r'^jaxdp:num_requests_total\{dp_rank="(\d+)"\} (\S+)$', text,
                                                    flags=re.M)}


def test_sweep_writes_json_and_plot(server, tmp_path, capsys):
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["--base-url", server, *RUN, "--sweep-concurrency", "1,4", "--output-file", str(out),
               "--plot", str(png)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Output token throughput (tok/s)" in printed and "Median TPOT (ms)" in printed
    points = json.loads(out.read_text())["results"]
    assert [p["max_concurrency"] for p in points] == [1, 4]
    for p in points:
        assert p["completed"] == 8 and p["failed"] == 0
        assert p["request_throughput"] > 0 and p["output_throughput"] > 0 and p["input_throughput"] > 0
        assert p["total_input_tokens"] == 64 and p["total_output_tokens"] == 32
        assert p["ttft_ms"]["median"] > 0 and p["tpot_ms"]["median"] > 0 and p["e2e_latency_ms"]["p99"] > 0
        assert p["itl_ms"]["mean"] > 0
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_skewed_pinning_lands_on_the_named_ranks(server, tmp_path):
    before = finished_per_rank(server)
    out = tmp_path / "pinned.json"
    rc = main(["--base-url", server, *RUN, "--max-concurrency", "4", "--routed-dp-rank", "skewed:3,1",
               "--warmup-requests", "0", "--output-file", str(out)])
    assert rc == 0
    assert json.loads(out.read_text())["results"][0]["requests_per_dp_rank"] == {"0": 6, "1": 2}
    after = finished_per_rank(server)
    delta = {r: after.get(r, 0) - before.get(r, 0) for r in range(8)}
    assert delta == {0: 6, 1: 2, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0}


def test_open_loop_openai_backend(server):
    assert main(["--base-url", server, *RUN, "--backend", "openai", "--request-rate", "50",
                 "--routed-dp-rank", "0,1,2,3"]) == 0


def test_rank_patterns():
    assert rank_pattern("none", 3) == [None] * 3
    assert rank_pattern("0", 3) == [0, 0, 0]
    assert rank_pattern("0,1,2", 5) == [0, 1, 2, 0, 1]
    skewed = rank_pattern("skewed:40,8,8,8", 64)
    assert [skewed.count(r) for r in range(4)] == [40, 8, 8, 8]


def test_errors_exit_2(capsys):
    port = free_port()
    assert main(["--base-url", f"http://127.0.0.1:{port}", *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot reach the server") and "\n" not in err
    assert main(["--routed-dp-rank", "skewed:a,b"]) == 2
    assert main(["--no-such-flag"]) == 2
    assert capsys.readouterr().err.count("error: ") == 2


@pytest.mark.slow  # three processes compile their buckets: about 1 min quiet, 3 min on a loaded 2-core machine
def test_versus_runs_engine_and_server_at_the_same_load(tmp_path):
    """`python -m jaxdp.bench.versus`: both offline runs and the server's rounds finish every token of the load,
    and the ratio and the CPU accounting are what they say they are."""
    import json
    import subprocess
    import sys

    out = tmp_path / "v.json"
    subprocess.run([sys.executable, "-m", "jaxdp.bench.versus", "--concurrency", "16", "--output-len", "8",
                    "--rounds", "1", "--with-in-process", "--json", str(out)], check=True, timeout=900,
                   capture_output=True)
    r = json.loads(out.read_text())
    (one_round,) = r["server_rounds"]  # between two offline rounds, against their mean
    assert one_round["failed"] == 0 and len(r["offline_rounds_tok_s"]) == 2
    assert one_round["offline_around_tok_s"] == pytest.approx(sum(r["offline_rounds_tok_s"]) / 2)
    assert r["server_over_offline"] == one_round["tokens_per_s"] / one_round["offline_around_tok_s"] > 0
    # the default server: the engine in a process of its own, its HTTP process on the client's CPU
    assert r["http_cpus"] == r["client_cpus"] and r["server_threads_cpu_us_per_token"]["engine_process_other"] > 0
    one = r["in_process"]  # the same load again, with --no-engine-process: one process on the engine's CPUs
    assert one["server_rounds"][0]["failed"] == 0 and one["http_cpus"] is None
    assert "engine_process_other" not in one["server_threads_cpu_us_per_token"]
    assert r["client_cpu_us_per_token"] > 0 and r["server_cpu_us_per_token"] > 0
    assert set(r["engine_cpus"]).isdisjoint(r["client_cpus"])


def test_client_cost_against_a_null_server(tmp_path):
    """`python -m jaxdp.bench.client_cost`: both clients read every event of every stream from the null server,
    which sees every request arrive, and the figures are in order."""
    import json
    import subprocess
    import sys

    out = tmp_path / "c.json"
    subprocess.run([sys.executable, "-m", "jaxdp.bench.client_cost", "--concurrency", "32", "--output-len", "8",
                    "--rounds", "1", "--json", str(out)], check=True, timeout=120, capture_output=True)
    r = json.loads(out.read_text())
    assert [x["client"] for x in r["rounds"]] == ["aiohttp", "httpx"]
    for x in r["rounds"]:
        assert x["output_tokens"] == 32 * 8
        assert 0 < x["first_arrival_ms"] <= x["median_arrival_ms"] <= x["last_arrival_ms"]
        assert x["duration_ms"] > 0 and x["client_cpu_us_per_token"] > 0


def test_disagg_granularities_side_by_side(tmp_path):
    """`python -m jaxdp.bench.disagg --granularity all layer chunk` on a tiny KV format: every value arrives
    (`--check`), each granularity moves the same bytes in its own number of transfers (one; one per layer; one
    per prompt step), and the table prints each beside the all-at-once figure; a prompt step that is not whole
    transfer chunks is one sentence."""
    import subprocess
    import sys

    out = tmp_path / "d.json"
    run = subprocess.run([sys.executable, "-m", "jaxdp.bench.disagg", "--tokens", "40", "100", "--layers", "3",
                          "--width", "8", "--dtype", "float32", "--chunk-tokens", "16", "--prefill-chunk", "32",
                          "--step-ms", "20", "--rounds", "1", "--granularity", "all", "layer", "chunk", "--check",
                          "--json", str(out)], timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rounds"]
    got = {(r["tokens"], r["granularity"]): r for r in rows}
    assert len(rows) == len(got) == 6
    for n, steps in ((40, 2), (100, 4)):
        assert {g: got[n, g]["transfers"] for g in ("all", "layer", "chunk")} == {"all": 1, "layer": 3, "chunk": steps}
        assert len({got[n, g]["bytes"] for g in ("all", "layer", "chunk")}) == 1
        for g in ("all", "layer", "chunk"):
            r = got[n, g]
            assert r["prompt_steps"] == steps and r["wait_ms"] > 0 and r["fetch_gb_s"] > 0 and r["wait_gb_s"] > 0
            assert r["total_ms"] >= r["wait_ms"] + 0.9 * steps * 20  # the prompt's steps, then the wait
    lines = [line.split() for line in run.stdout.splitlines()]
    for n in ("40", "100"):
        assert [x[1] for x in lines if x and x[0] == n] == ["all", "layer", "chunk"]
        assert [x[-1] for x in lines if x and x[0] == n][0] == "1.00"  # the all-at-once wait, the ratios' base
    bad = subprocess.run([sys.executable, "-m", "jaxdp.bench.disagg", "--prefill-chunk", "100"], timeout=120,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--prefill-chunk 100 must be a positive multiple of --chunk-tokens 256")
