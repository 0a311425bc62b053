"""Two-batch overlap's XLA flags: on a GPU the server starts XLA with its analytical latency estimator and no
combining of collectives (`jaxdp.parallel.tbo.xla_flags`, set by `jaxdp.serve.start_xla_flags` before JAX's
backends start), unless the user set a flag; nothing changes on a CPU or with the overlap off."""

import pytest

from jaxdp.parallel.tbo import GPU_FLAGS, xla_flags
from jaxdp.serve import build_parser, start_xla_flags
from jaxdp.serve_config import serve_config

SOL = "--xla_gpu_enable_analytical_sol_latency_estimator"


def _config(*flags):
    return serve_config(build_parser().parse_args(["--mesh", "dp=8,moe=ep", *flags]))


def test_flags_on_a_gpu_only_and_the_users_own_kept():
    out = xla_flags("--xla_force_host_platform_device_count=8", "cuda")
    assert out.split() == ["--xla_force_host_platform_device_count=8", *(f"--{n}={v}" for n, v in GPU_FLAGS)]
    assert f"{SOL}=true" in out and "--xla_gpu_all_gather_combine_threshold_bytes=0" in out
    mine = xla_flags(f"{SOL}=false", "gpu")  # the user's estimator stays; the other flags join it
    assert mine.split().count(f"{SOL}=false") == 1 and f"{SOL}=true" not in mine and len(mine.split()) == 5
    assert xla_flags("--a=1", "cpu") == "--a=1" and xla_flags("", "cpu") == ""


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_server_start_sets_them_with_two_batch_overlap_on_a_gpu(platform):
    env = {"XLA_FLAGS": "--xla_gpu_reduce_scatter_combine_threshold_bytes=1024"}
    start_xla_flags(_config("--enable-two-batch-overlap"), env, platform)
    flags = env["XLA_FLAGS"].split()
    assert flags[0] == "--xla_gpu_reduce_scatter_combine_threshold_bytes=1024"  # the user's, kept
    if platform == "cuda":
        assert f"{SOL}=true" in flags and "--xla_gpu_all_gather_combine_threshold_bytes=0" in flags
        assert not any(f.startswith("--xla_gpu_reduce_scatter_combine_threshold_bytes=0") for f in flags)
    else:
        assert flags == ["--xla_gpu_reduce_scatter_combine_threshold_bytes=1024"]
    off = {}
    start_xla_flags(_config(), off, "cuda")  # two-batch overlap off: XLA's defaults
    assert off == {}
