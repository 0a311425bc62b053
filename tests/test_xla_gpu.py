"""The GPU on paper in the suite: the GPU's own paths compiled by XLA:GPU for simulated H200s.

The CUDA plugin cannot sit in the test environment itself (without a CUDA driver every JAX process then prints
lines on stderr, which the CLI tests read: docs/gpu-on-paper.md), so this test installs the `xla-gpu` extra's
two wheels, pinned in pyproject.toml, into a cache folder of their own and runs the GPU-on-paper and
kernel-compile tests in a process that has them on its path. In that process the plugin is found and this test
skips itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jaxdp.planner.xla_target import plugin_installed

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ["tests/test_gpu_on_paper.py", "tests/test_kernels_mla.py", "tests/test_kernels_nvfp4.py",
             "tests/test_kernels_fp8.py"]


def plugin_folder() -> Path:
    """The extra's wheels, installed once into ~/.cache/jaxdp (a folder per pinned set)."""
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["xla-gpu"]
    name = "xla-gpu-" + "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", p) for p in pins)
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxdp" / name
    if not folder.exists():
        part = folder.with_name(folder.name + ".part")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(part), *pins], check=True, capture_output=True, timeout=900)
        part.rename(folder)
    return folder


@pytest.mark.skipif(plugin_installed(), reason="the plugin is on this process's path: the GPU tests run here")
def test_the_gpu_paths_compile_with_xla_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plugin_folder()), str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          "gpu_on_paper or simulated", *GPU_TESTS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, summary  # every GPU test ran, none skipped
