"""SGLang's router in front of a prefill and a decode server, for the experiments and benchmarks that need it.

`sglang-router` (0.3.2 measured here) is SGLang's, not jaxdp's: it lives in a venv of its own (the tests'
fixture installs it under `~/.cache/jaxdp/sglang-router-0.3.2`), or in this Python if installed there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from jaxdp.net import free_port

ROUTER_VERSION = "0.3.2"
ROUTER_VENV = Path.home() / ".cache" / "jaxdp" / f"sglang-router-{ROUTER_VERSION}"


def router_python() -> str | None:
    """A Python that runs `sglang_router`: the venv the tests install, or this one; None if neither."""
    venv = ROUTER_VENV / "bin" / "python"
    if (ROUTER_VENV / ".installed").exists() and venv.exists():
        return str(venv)
    if importlib.util.find_spec("sglang_router") is not None:
        return sys.executable
    return None


@contextlib.contextmanager
def launch_router(prefill_url: str, bootstrap_port: int, decode_url: str, log: Path, *extra: str,
                  timeout_s: float = 120) -> Iterator[str]:
    """`python -m sglang_router.launch_router --pd-disaggregation` on a free port of 127.0.0.1 for the `with`
    block; yields its URL. RuntimeError in one sentence if the router is not installed or does not start."""
    python = router_python()
    if python is None:
        raise RuntimeError(f"SGLang's router is not installed: python -m venv {ROUTER_VENV} && {ROUTER_VENV}/bin/pip "
                           f"install sglang-router=={ROUTER_VERSION} && touch {ROUTER_VENV}/.installed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen([python, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
                                 prefill_url, str(bootstrap_port), "--decode", decode_url, "--host", "127.0.0.1",
                                 "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                 str(free_port()), *extra], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"SGLang's router did not start (see {log})")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
