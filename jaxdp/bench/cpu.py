"""CPU seconds of a live process, whole or by kind of thread (Linux /proc), for the benchmarks that say where
the CPU went."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_seconds(stat: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) of one /proc/.../stat line."""
    name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    return _stat_seconds(Path(f"/proc/{pid}/stat").read_text())[1]


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """A live process's CPU seconds by kind of thread: its main thread (in the server the event loop: HTTP,
    SSE, the streams; in `Engine.generate` the engine's loop), jaxdp's own threads (named `jaxdp-*`: the
    server's engine loop, the monitor, the watchdog) and the others (XLA's, whatever their names)."""
    out = {"main": 0.0, "jaxdp": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, seconds = _stat_seconds(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        kind = "main" if int(tid) == pid else "jaxdp" if name.startswith("jaxdp-") else "other"
        out[kind] += seconds
    return out


def child_pids(pid: int) -> list[int]:
    """The live process's children (a server's engine process, with --engine-process)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except FileNotFoundError:
            continue
    return out
