"""Several hosts: one model world across processes on JAX's distributed runtime, a scheduler loop per host.

Every node calls `jax.distributed.initialize` (`init_distributed`); the mesh then spans all nodes' devices,
ordered node by node, so adjacent DP ranks (and every TP group) sit on one node. Node 0 runs the HTTP server,
the tokenizer and the controller; every node runs an `Engine` whose loop drives the schedulers of its own DP
ranks and feeds their rows to the same compiled step (multi-controller SPMD: each process supplies its
devices' shards, the collectives run across processes; gloo on the CPU).

Each loop iteration the nodes trade one small message each through the runtime's key-value store
(`HostExchange.exchange`): their ranks' proposals (the agreement's few integers per rank), so every node
reaches the same bucket and mode; riding on it, node 0's new requests and aborts for other nodes' ranks,
and from the other nodes their requests' new tokens and their ranks' states. Every wait is bounded by
`timeout_s`: a node that dies or stops answering ends the others with a `PeerFailure` that names it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import pickle
import socket
import time
from typing import Any

log = logging.getLogger("jaxdp.hosts")


class DistError(ValueError):
    """A multi-node set-up the user must change (bad address, port in use, unreachable coordinator)."""


class PeerFailure(RuntimeError):
    """Another node died or stopped answering; the message says which and what was happening."""


class PeerStopped(RuntimeError):
    """Node 0 shut down in order; the other nodes end too."""


@dataclasses.dataclass(frozen=True)
class DistConfig:
    nnodes: int = 1
    node_rank: int = 0
    addr: str | None = None  # HOST:PORT of node 0's coordinator; IPv6 in brackets: [::1]:5000
    timeout_s: float = 60.0  # longest wait for another node in a step (start-up waits init_timeout_s)
    init_timeout_s: float = 300.0  # for every node to start and for the slowest one to compile its steps

    @property
    def multi(self) -> bool:
        return self.nnodes > 1


def parse_dist_addr(addr: str) -> tuple[str, int]:
    """"10.0.0.1:5000" / "node0:5000" / "[::1]:5000" -> (host, port); DistError saying what is wrong."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistError(f"--dist-init-addr {addr!r} must be HOST:PORT (an IPv6 address in brackets, e.g. "
                        "[::1]:5000)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise DistError(f"--dist-init-addr {addr!r}: {host!r} in brackets is not an IPv6 address") from None
    elif ":" in host:
        raise DistError(f"--dist-init-addr {addr!r}: put an IPv6 address in brackets, e.g. [{host}]:{port}")
    if not host:
        raise DistError(f"--dist-init-addr {addr!r} has no host; e.g. 10.0.0.1:5000 or [::1]:5000")
    return host, int(port)


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_dist_args(nnodes: int, node_rank: int, addr: str | None) -> None:
    if nnodes < 1:
        raise DistError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise DistError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} for --nnodes {nnodes}")
    if nnodes > 1 and not addr:
        raise DistError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)")
    if addr:
        parse_dist_addr(addr)


def _check_coordinator_port(host: str, port: int) -> None:
    """Node 0 binds the coordinator on every interface at `port`: say so now if that port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        except OSError as e:
            raise DistError(f"node 0 cannot listen on port {port} for --dist-init-addr ({e.strerror}); "
                            "pick a free port and pass the same --dist-init-addr to every node") from None


def _wait_for_coordinator(host: str, port: int, dist: DistConfig) -> None:
    """Nodes > 0: wait until node 0's coordinator accepts connections. (JAX's client aborts the whole
    process when it cannot register in time; a plain connect lets us say what is wrong instead.)"""
    deadline = time.monotonic() + dist.init_timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
            time.sleep(0.5)
    raise DistError(f"node {dist.node_rank} could not reach node 0 at {grpc_address(host, port)} within "
                    f"{dist.init_timeout_s:.0f} s ({last}); start node 0 first, check --dist-init-addr (node 0's "
                    "address and a free port, the same on every node) and the firewall")


def init_distributed(dist: DistConfig) -> None:
    """Join the model world (before anything else touches JAX's backends)."""
    import jax

    host, port = parse_dist_addr(dist.addr)
    if dist.node_rank == 0:
        _check_coordinator_port(host, port)
    else:
        _wait_for_coordinator(host, port, dist)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.config.update("jax_enable_recoverability", True)  # a dead node must not take node 0 down with it
    bind = f"[::]:{port}" if ":" in host else f"0.0.0.0:{port}"
    t0 = time.perf_counter()
    log.info("node %d/%d: joining the model world at %s (waiting up to %.0f s for every node)", dist.node_rank,
             dist.nnodes, grpc_address(host, port), dist.init_timeout_s)
    try:
        jax.distributed.initialize(grpc_address(host, port), dist.nnodes, dist.node_rank,
                                   coordinator_bind_address=bind, initialization_timeout=int(dist.init_timeout_s),
                                   heartbeat_timeout_seconds=max(10, int(dist.timeout_s)),
                                   shutdown_timeout_seconds=max(5, int(min(dist.timeout_s, 30))))
    except Exception as e:  # the runtime says DEADLINE_EXCEEDED / UNAVAILABLE in a long gRPC message
        raise DistError(f"node {dist.node_rank} could not join the model world at {grpc_address(host, port)} "
                        f"within {dist.init_timeout_s:.0f} s ({first_line(e)}); check that node 0 runs and that every "
                        "node has the same --dist-init-addr and --nnodes") from None
    log.info("node %d/%d: joined in %.1f s; %d devices here, %d in all", dist.node_rank, dist.nnodes,
             time.perf_counter() - t0, jax.local_device_count(), jax.device_count())


def world_devices(world: int, nnodes: int) -> list[Any]:
    """The model world's devices, node by node: the first world/nnodes devices of each process (so adjacent
    ranks, and every TP group, sit on one node)."""
    import jax

    per = world // nnodes
    by_node: dict[int, list] = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_node.setdefault(d.process_index, []).append(d)
    short = {p: len(ds) for p, ds in by_node.items() if len(ds) < per}
    if len(by_node) != nnodes or short:
        raise DistError(f"the model world has {len(by_node)} nodes with {[len(v) for v in by_node.values()]} "
                        f"devices; --mesh needs {nnodes} nodes of {per} devices each")
    return [d for p in sorted(by_node) for d in by_node[p][:per]]


def _client():
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized; call init_distributed first")
    return distributed.global_state.client


class HostExchange:
    """The agreement's exchange across nodes, through the distributed runtime's key-value store.

    `exchange(proposals, message)`: every node posts its own ranks' proposals and a message under the
    iteration's key, then reads every other node's; all return the same full list of proposals and all
    messages. Keys live in directories of BLOCK iterations, which node 0 deletes once every node is past.
    """

    def __init__(self, nnodes: int, node_rank: int, dp: int, timeout_s: float, *, init_timeout_s: float = 300.0,
                 client=None, prefix="jaxdp"):
        if dp % nnodes:
            raise DistError(f"{dp} DP ranks do not split evenly over --nnodes {nnodes}")
        self.nnodes, self.node_rank, self.dp, self.timeout_s = nnodes, node_rank, dp, timeout_s
        self.init_timeout_s = init_timeout_s
        self.per_node = dp // nnodes
        self.client = client or _client()
        self.prefix = prefix
        self.seq = 0

    def local_ranks(self, node: int | None = None) -> range:
        node = self.node_rank if node is None else node
        return range(node * self.per_node, (node + 1) * self.per_node)

    def owner(self, rank: int) -> int:
        return rank // self.per_node

    BLOCK = 64  # iterations per key directory; node 0 deletes a finished directory in one call

    def _key(self, seq: int, node: int) -> str:
        return f"{self.prefix}/b{seq // self.BLOCK}/x{seq}/n{node}"

    def exchange(self, proposals: list, message: dict) -> tuple[list, list[dict]]:
        mine = self.local_ranks()
        self.client.key_value_set_bytes(self._key(self.seq, self.node_rank),
                                        pickle.dumps((proposals[mine.start:mine.stop], message)))
        full, messages = list(proposals), [message] * self.nnodes
        for node in range(self.nnodes):
            if node == self.node_rank:
                continue
            try:
                raw = self.client.blocking_key_value_get_bytes(self._key(self.seq, node), int(self.timeout_s * 1000))
            except Exception as e:
                raise PeerFailure(f"node {node} did not answer the step exchange #{self.seq} within "
                                  f"{self.timeout_s:.0f} s ({_short(e)}): it died or stopped") from None
            theirs, msg = pickle.loads(raw)
            r = self.local_ranks(node)
            full[r.start:r.stop] = theirs
            messages[node] = msg
        # every node has posted this iteration, so every node has read all keys of the ones before it
        if self.node_rank == 0 and self.seq % self.BLOCK == 0 and self.seq > 0:
            try:
                self.client.key_value_delete(f"{self.prefix}/b{self.seq // self.BLOCK - 1}")
            except Exception:  # the coordinator is going away; the next exchange reports it
                pass
        self.seq += 1
        return full, messages

    def barrier(self, name: str, timeout_s: float) -> None:
        """Wait for every node (after start-up compiles, which take different times on different nodes)."""
        try:
            self.client.wait_at_barrier(f"{self.prefix}/{name}", int(timeout_s * 1000))
        except Exception as e:
            raise PeerFailure(f"not every node reached '{name}' within {timeout_s:.0f} s ({_short(e)})") from None


def first_line(e: Exception, limit: int = 200) -> str:
    """The first line of an error's message (a runtime error's is a long gRPC story)."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def _short(e: Exception) -> str:
    """The status word of a runtime error ("DEADLINE_EXCEEDED"), not its whole gRPC story."""
    text = str(e).strip()
    return text.split(":")[0].strip()[:60] if text else type(e).__name__


def local_device_count(world: int, nnodes: int, tp: int) -> int:
    """Devices each node contributes; DistError unless the world splits into whole DP groups per node."""
    if world % nnodes:
        raise DistError(f"the mesh's {world} devices do not split evenly over --nnodes {nnodes}")
    per = world // nnodes
    if per % tp:
        raise DistError(f"each node holds {per} devices, which does not fit whole TP groups of {tp}; a TP group "
                        "must stay on one node (choose --tp-size dividing the devices per node)")
    return per


def exit_now(code: int) -> None:
    """End a non-zero node without waiting for JAX's shutdown barrier (the other nodes may be gone)."""
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(code)
