"""Ports on this host: the product's own processes (SGLang's router in front of two servers, their metrics)
and the benchmarks' and tests' servers take one that nothing else holds."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the OS picks it; nothing holds it afterwards, so two
    calls in a row may give the same port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
