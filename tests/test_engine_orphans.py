"""No engine process outlives its server: SIGKILL of the server while its engine process starts (loading the model,
compiling the steps) or serves ends that process within moments, with one line in the log saying why; SIGTERM of a
server that is still starting ends both (`jaxdp.engine.ipc.process.ServerWatch`, the server's start-up SIGTERM)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from servers import Server, group_alive

from jaxdp.bench.cpu import child_pids

ARGS = ["--engine-process", "--model-path", "tiny", "--mesh", "dp=2", "--cuda-graph-bs", "4",
        "--chunked-prefill-size", "32", "--max-total-tokens", "2048"]
GONE_LINE = "the server's process is gone; the engine process ends"


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie nobody reaped yet has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def engine_child(server: Server, after: str | None = None, timeout: float = 120) -> int:
    """The server's engine process, once it runs (and, with `after`, once that text is in the log), while the
    server is not yet serving."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert server.proc.poll() is None, server.log.read_text()[-3000:]
        children = child_pids(server.proc.pid) if running(server.proc.pid) else []
        if children and (after is None or after in server.log.read_text()):
            return children[0]
        time.sleep(0.05)
    raise AssertionError(f"no engine process (or no {after!r}) within {timeout} s:\n{server.log.read_text()[-3000:]}")


def ends_within(pid: int, seconds: float) -> float:
    t0 = time.time()
    while running(pid) and time.time() - t0 < seconds:
        time.sleep(0.05)
    assert not running(pid), f"the engine process {pid} outlived its server by {seconds} s"
    return time.time() - t0


def test_sigkill_of_the_server_while_its_engine_process_compiles_ends_it(tmp_path):
    s = Server(ARGS, tmp_path / "server.log")
    try:
        child = engine_child(s, after="KV Cache is allocated")  # the model is loaded; the steps compile next
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
        ends_within(child, 5)
        assert GONE_LINE in s.log.read_text()
    finally:
        s.stop()
    assert not group_alive(s.proc.pid)


def test_sigterm_of_a_starting_server_ends_its_engine_process_and_exits_0(tmp_path):
    s = Server(ARGS, tmp_path / "server.log")
    try:
        child = engine_child(s)
        time.sleep(1.0)  # the child is importing, or loading the model
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(20) == 0, s.log.read_text()[-3000:]
        ends_within(child, 2)  # the server killed it and waited for it before it exited
        assert "SIGTERM during start-up" in s.log.read_text()
    finally:
        s.stop()


def test_sigkill_of_a_serving_server_ends_its_engine_process(tmp_path):
    s = Server([*ARGS, "--disable-cuda-graph"], tmp_path / "server.log").wait()  # serving at once, compiling later
    try:
        (child,) = child_pids(s.proc.pid)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
        ends_within(child, 5)
        assert GONE_LINE in s.log.read_text()
    finally:
        s.stop()


def test_stopping_a_starting_server_leaves_no_process_of_its_group(tmp_path):
    """tests/servers.py's stop, as a test that gives up on a server still starting calls it."""
    s = Server(ARGS, tmp_path / "server.log")
    engine_child(s)
    s.stop()
    assert not group_alive(s.proc.pid)
