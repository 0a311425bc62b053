"""Servers that the benchmarks and experiments start: a free port on loopback, and the wait for /health."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx


class NotReady(RuntimeError):
    """A started server exited, or did not answer /health in time; the message says which and names its log."""


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float, poll_s: float = 0.5,
                 name: str = "the server") -> None:
    """Return once `url`/health answers 200; NotReady if `proc` exits first (its last log line in the message)
    or after `timeout_s` (the caller stops it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
            raise NotReady(f"{name} exited with status {proc.returncode} before it was ready ({tail[0][:300]}); "
                           f"see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(poll_s)
    raise NotReady(f"{name} was not ready within {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM a server started in a session of its own; SIGKILL its whole group if it has not ended in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
