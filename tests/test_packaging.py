"""The package as a user installs it: a wheel (not the checkout) carries the mesh presets and the default model, so
`python -m jaxdp.plan --mesh dp8-ep8` works from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_wheel_installed_elsewhere_finds_its_presets(tmp_path):
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl")],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "whl").glob("jaxdp-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(tmp_path / "site")}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    where = subprocess.run([sys.executable, "-c", "import jaxdp.layout as m; print(m.MESHES_DIR)"], **run)
    assert where.stdout.strip().startswith(str(tmp_path / "site")), where.stdout + where.stderr
    out = subprocess.run([sys.executable, "-m", "jaxdp.plan", "--model", "deepseek-v3", "--gpus", "8", "--gpu", "H200",
                          "--mesh", "dp8-ep8", "--expert-dtype", "fp8"], **run)
    assert out.returncode == 0, out.stderr
    assert "dp=8 x tp=1 attention groups, MoE ep over 8 devices" in out.stdout
    assert (tmp_path / "site" / "jaxdp" / "assets" / "default-model" / "model.safetensors").is_file()
    assert (tmp_path / "site" / "jaxdp" / "planner" / "targets" / "h200.pbtxt").is_file()  # XLA:GPU targets
