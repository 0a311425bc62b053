"""A node's process: nodes > 0 run under a supervising parent that turns the distributed runtime's abort
(node 0 gone) into one line, and every node ends without JAX's shutdown barrier once the others may be gone."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys


def exit_now(code: int) -> None:
    """End a non-zero node without waiting for JAX's shutdown barrier (the other nodes may be gone)."""
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(code)


def supervise_node(child_argv: list[str], node_rank: int) -> int:
    """Nodes > 0 run as a child of this process: JAX's runtime aborts a node whose coordinator (node 0)
    vanishes or has given it up (it missed its heartbeats, e.g. stalled), and the parent then says in one line
    what that means, in the form the node's own failures take ("error: node N: ..."). Signals are passed on
    to the child."""
    child = subprocess.Popen([sys.executable, *child_argv], env={**os.environ, NODE_CHILD_ENV: "1"},
                             preexec_fn=_die_with_parent)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    if code < 0 and -code not in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        print(f"error: node {node_rank}: stopped by JAX's distributed runtime ({signal.Signals(-code).name}): node 0 "
              "died, became unreachable or gave this node up (it stalled past the heartbeat timeout); restart every "
              "node with the same --dist-init-addr", file=sys.stderr)
        return 1
    return code if code >= 0 else 128 - code


NODE_CHILD_ENV = "JAXDP_NODE_CHILD"  # set in the supervised child


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when the supervising parent dies (kill -9 of the node kills both)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
