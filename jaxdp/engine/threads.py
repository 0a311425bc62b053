"""The library's own threads, named for the operating system too, so `top -H`, py-spy and
/proc/PID/task/*/comm tell the engine's loop, the monitor and the watchdog from XLA's threads (Python 3.11
names a thread for Python only)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable

_PR_SET_NAME = 15


def _set_os_name(name: str) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)  # the kernel keeps 15 bytes
    except (OSError, AttributeError):  # no libc to ask: the name stays Python's only
        pass


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start a daemon thread running `target`, named `name` for Python and for the operating system."""

    def run() -> None:
        _set_os_name(name)
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
