"""`--enable-deterministic-inference` (issue 48, docs/determinism.md): under `--mesh dp=8` with the embedded default
model, one greedy prompt (the probe) answers the same token ids AND the same logprobs bit for bit alone, after a
prefix-cache hit, on another rank and among 3, 15 and 31 other prompts (steps of other row counts, buckets and
page-table widths, chunked with them); without the flag the same sequence gives several logprob sets on this
machine (a prefix-cache hit changes the prompt attention's form), so the first test can fail. The server form,
`python -m jaxdp.bench.deterministic` in its three modes against a live server with the flag, is the slow test."""

from __future__ import annotations

import json

import numpy as np
import pytest
from servers import Server

from jaxdp.bench.deterministic import main
from jaxdp.engine import Engine, EngineConfig, SamplingParams
from jaxdp.model.loader import default_model_path
from jaxdp.ops.registry import deterministic_backend, deterministic_model_refusal
from jaxdp.serve import UserError, build_parser, serve_config

HAVE_DEFAULT = (default_model_path() / "tokenizer.json").exists()
needs_model = pytest.mark.skipif(not HAVE_DEFAULT, reason="the embedded default model (with its tokenizer) is absent")


def ids(tok, text: str) -> list[int]:
    e = tok.encode(text)
    return e if isinstance(e, list) else e.ids


COMPANIES = [("alone, rank 0", 0, 0, False), ("cached, rank 0", 0, 0, True), ("alone, rank 1", 0, 1, True),
             ("among 3, rank 0", 3, 0, True), ("among 15, rank 3", 15, 3, True), ("among 31, rank 5", 31, 5, True)]


def probe_answers(deterministic: bool, companies=COMPANIES) -> dict[str, tuple]:
    """The probe's (ids, logprobs as float.hex) in each company, from one dp=8 engine."""
    cfg = EngineConfig(page_size=16, num_pages=64, max_running_requests=64, chunked_prefill_size=512,
                       disable_cuda_graph=True)
    eng = Engine("default", "dp=8", cfg, warmup=False, deterministic=deterministic)
    rng = np.random.default_rng(0)
    letters = lambda n: "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=n))  # noqa: E731
    probe = ids(eng.tokenizer, f"reverse {letters(40)}=")
    others = [ids(eng.tokenizer, f"reverse {letters(int(rng.integers(16, 49)))}=" if i % 2 else
                  f"{int(rng.integers(1, 99))}+{int(rng.integers(1, 99))}=") for i in range(31)]
    sp = SamplingParams(max_new_tokens=24, temperature=0, return_logprob=True)
    out = {}
    for name, n, rank, flush in companies:
        r = eng.generate(others[:n] + [probe], sp, ranks=[None] * n + [rank])[-1]
        assert r.output_ids and len(r.output_logprobs) == len(r.output_ids)
        out[name] = (tuple(r.output_ids), tuple(float(v).hex() for v in r.output_logprobs), r.cached_tokens)
        if flush:
            eng.flush_cache()
    assert out["cached, rank 0"][2] > 0  # the hit happened
    assert all(out[name][2] == 0 for name in out if name != "cached, rank 0")  # the flushes too
    eng.shutdown()
    return out


@needs_model
def test_flag_makes_the_probe_bit_identical_under_dp8():
    out = probe_answers(True)
    assert len({v[0] for v in out.values()}) == 1, "greedy token ids differ"
    sets = {v[1] for v in out.values()}
    assert len(sets) == 1, f"{len(sets)} logprob sets: " + json.dumps({k: v[1][:3] for k, v in out.items()})


@needs_model
def test_without_the_flag_logprobs_differ_on_this_machine():
    """What the flag fixes, shown: today's default kernels give the probe another logprob set after a prefix-cache
    hit than cold (the same ids: the default model's margins are wide)."""
    out = probe_answers(False, COMPANIES[:2])
    assert len({v[0] for v in out.values()}) == 1
    assert len({v[1] for v in out.values()}) > 1


def test_flag_refusals_are_one_sentence():
    for call, says in [(lambda: deterministic_backend("mla_decode", "xla", "cpu"), "leave out --attention-backend xla"),
                       (lambda: deterministic_backend("expert_gemm", "blocked", "cpu"), "--moe-runner-backend"),
                       (lambda: deterministic_backend("projection_gemm", None, "gpu"), "on a GPU")]:
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith("--enable-deterministic-inference ") and says in msg and "\n" not in msg
    assert deterministic_backend("mla_decode", "native", "cpu") == "native"
    # the server refuses a conflicting backend flag before anything loads
    args = build_parser().parse_args(["--enable-deterministic-inference", "--attention-backend", "xla"])
    with pytest.raises(UserError, match="^--enable-deterministic-inference runs --attention-backend native"):
        serve_config(args)
    assert serve_config(build_parser().parse_args(["--enable-deterministic-inference"])).model.deterministic


@pytest.mark.parametrize("model, extra, says", [
    ("tiny", [], "qk_rope_head_dim 8 (not a multiple of 16), kv_lora_rank 32 (not a multiple of 64)"),
    ("glm-5-tiny", [], "DSA's sparse attention"),
    ("default", ["--quantization", "fp8"], "--quantization fp8"),
    ("default", ["--quantization", "nvfp4"], "--quantization nvfp4")])
def test_flag_refuses_models_the_native_kernels_do_not_take(model, extra, says):
    """A model whose products would fall back to XLA's shape-dependent forms (widths the native kernels do not
    tile, quantized weights, DSA layers) is refused in one sentence before any weight loads; without the flag
    the same flags pass this check."""
    if model == "default" and not HAVE_DEFAULT:
        pytest.skip("the embedded default model is absent")
    argv = ([] if model == "default" else ["--model-path", model]) + extra
    with pytest.raises(UserError) as e:
        serve_config(build_parser().parse_args(["--enable-deterministic-inference", *argv]))
    msg = str(e.value)
    assert msg.startswith("--enable-deterministic-inference ") and says in msg and "\n" not in msg, msg
    assert msg.endswith("or leave the flag out")
    assert not serve_config(build_parser().parse_args(argv)).model.deterministic


def test_model_refusal_reads_the_widths_and_the_block_fp8_config():
    """The check itself on configs: the default model's and DeepSeek-V3's widths pass; a block-FP8 config, a
    per-head width off 16 and a hidden size off 16 are each named."""
    from jaxdp.config import PRESETS
    v3 = PRESETS["deepseek-v3"]
    assert deterministic_model_refusal(v3) is None
    assert "block-FP8 weights" in deterministic_model_refusal(v3.with_(fp8_block=(128, 128)))
    assert "NVFP4 experts" in deterministic_model_refusal(v3, nvfp4_checkpoint=True)
    assert "v_head_dim 120 (not a multiple of 16)" in deterministic_model_refusal(v3.with_(v_head_dim=120))
    assert "hidden_size 7000" in deterministic_model_refusal(v3.with_(hidden_size=7000))
    assert "qk_nope" not in deterministic_model_refusal(v3.with_(hidden_size=7000))


SMALL = ["--chunked-prefill-size", "128", "--max-running-requests", "64", "--cuda-graph-bs", "4",
         "--decode-log-interval", "50", "--page-size", "16", "--max-total-tokens", "2048",
         "--enable-deterministic-inference"]


MODES = [("single", ["--trials", "6"]), ("mixed", ["--trials", "4"]),
         ("prefix", ["--trials", "3", "--prefix-lengths", "1,40,120"])]
SAMPLING = [[], ["--temperature", "1", "--seed", "7"]]


def bench_counts(server_args: list[str], tmp_path, modes=MODES, wait: float = 240) -> dict[str, list]:
    """`python -m jaxdp.bench.deterministic` in each mode, greedy and seeded at temperature 1, against one live
    `jaxdp.serve` started with `server_args`: {"mode, sampling": the per-prompt counts}."""
    server = Server([*server_args, *SMALL], tmp_path / "server.log")
    out = {}
    try:
        url = server.wait(wait).url
        for mode, extra in modes:
            for sampling in SAMPLING:
                path = tmp_path / f"{mode}{len(sampling)}.json"
                assert main(["--url", url, "--mode", mode, "--max-new-tokens", "24", "--max-batch", "8",
                             "--warmup", "1", "--output", str(path), *extra, *sampling]) == 0
                out[f"{mode}, {' '.join(sampling) or 'greedy'}"] = json.loads(path.read_text())["counts"]
    finally:
        server.stop()
    return out


def assert_one_sample(counts: dict[str, list]) -> None:
    assert all(c for c in counts.values())
    bad = {k: [(c["text"][:24], c["samples"], c["unique_ids"], c["unique_ids_logprobs"]) for c in v
               if (c["unique_ids"], c["unique_ids_logprobs"]) != (1, 1)] for k, v in counts.items()}
    bad = {k: v for k, v in bad.items() if v}  # (a prompt drawn into no trial, 0 samples, fails too)
    assert not any(bad.values()), bad


@needs_model
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["dp=8", "dp=8,moe=ep", "tp=8"])
def test_bench_command_with_the_flag_gives_one_sample(mesh, tmp_path):
    """`python -m jaxdp.bench.deterministic --mode single|mixed|prefix`, greedy and seeded at temperature 1,
    against `jaxdp.serve --mesh MESH --enable-deterministic-inference` with the default model: unique samples 1
    for token ids AND logprobs, every prompt (slow: a server start and compile, then 6 runs of seconds each)."""
    assert_one_sample(bench_counts(["--mesh", mesh], tmp_path))


def words(n: int, seed: int) -> str:
    """n random words of the peer checkpoint's word-level tokenizer ("w3" .. "w4095": one token each)."""
    rng = np.random.default_rng(seed)
    return " ".join(f"w{i}" for i in rng.integers(3, 4096, size=n))


@pytest.mark.slow
def test_bench_command_on_the_peer_checkpoint(tmp_path):
    """The same under `--mesh dp=8` with the peer checkpoint (`jaxdp.bench.peer_model`: 230 M parameters,
    DeepSeek-V3-shaped, hidden 1024, random weights; written once under jaxdp's cache, a minute or two), with
    prompts of its word-level vocabulary: unique samples 1 in the three modes, greedy and seeded."""
    from jaxdp.bench.peer_model import ensure_checkpoint

    path = ensure_checkpoint()
    modes = [("single", ["--trials", "6", "--prompt", words(40, 1)]),
             ("mixed", ["--trials", "4", "--prompts", "|".join(words(n, s) for n, s in ((3, 2), (6, 3), (24, 4)))]),
             ("prefix", ["--trials", "4", "--prompt", words(120, 6), "--prefix-lengths", "1,48,160,320"])]
    # (--grammar-backend none: llguidance cannot read a word-level tokenizer without a decoder)
    assert_one_sample(bench_counts(["--mesh", "dp=8", "--model-path", str(path), "--grammar-backend", "none"],
                                   tmp_path, modes, wait=600))


def test_an_engine_built_in_python_refuses_such_a_model_too():
    """The library path (`jaxdp.Engine`, `build_runners`) keeps the server's promise: a model the native kernels do
    not take is refused with the same sentence, after its config is known, rather than served non-deterministically."""
    import jax

    from jaxdp.engine.setup import build_runners
    from jaxdp.layout import parse_mesh_spec

    layout = parse_mesh_spec("dp=1")
    with pytest.raises(ValueError, match=r"^--enable-deterministic-inference needs widths the native kernels take"):
        build_runners("tiny", layout, [layout.make_mesh(jax.devices()[:1])], num_pages=4, page_size=16,
                      deterministic=True)
