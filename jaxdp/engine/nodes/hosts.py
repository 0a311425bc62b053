"""Several hosts: one model world across processes on JAX's distributed runtime, a scheduler loop per host.

Every node calls `jax.distributed.initialize` (`init_distributed`); the mesh then spans all nodes' devices,
ordered node by node, so adjacent DP ranks (and every TP group) sit on one node. Node 0 runs the HTTP server,
the tokenizer and the controller; every node runs an `Engine` whose loop drives the schedulers of its own DP
ranks and feeds their rows to the same compiled step (multi-controller SPMD: each process supplies its
devices' shards, the collectives run across processes; gloo on the CPU).

Each loop iteration the nodes trade one frame each (`HostExchange.exchange`, typed messages of
`jaxdp.engine.ipc.messages`, over ZeroMQ sockets whose addresses are traded once through a JAX collective): their
ranks' proposals (the agreement's few integers per rank), so every node reaches the same bucket and mode;
riding on it, node 0's new requests and aborts for other nodes' ranks and admin commands (a cache flush), and
from the other nodes their requests' new tokens, their ranks' states and their answers to those commands.
Every wait is bounded by `timeout_s`: a node that dies or stops answering ends the others with a `PeerFailure`
that names it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import struct
import time
from typing import Any

from jaxdp.engine.ipc.messages import Reader, WireError, encode, frame_reader

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


class CollectiveAddressBook:
    """The two key-value calls `ZmqGather` makes at start-up (post this node's socket address, then read every
    other node's) answered by one all-gather over every process with JAX's public collectives
    (`multihost_utils.process_allgather`). JAX 0.10 exposes its distributed runtime's key-value store only
    through a private module (its public `jax.distributed` has initialize, shutdown and is_initialized); the
    collective needs nothing private. Every node posts once,
    then reads: the first read runs the all-gather (all nodes make their exchange at the same point of start-up,
    after `jax.distributed.initialize` saw every node join)."""

    WIDTH = 512  # bytes of one node's (key, address)

    def __init__(self):
        self._posted: tuple[str, str] | None = None
        self._book: dict[str, str] | None = None

    def key_value_set(self, key: str, value: str) -> None:
        self._posted = (key, value)

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        if self._book is None:
            import numpy as np
            from jax.experimental import multihost_utils

            data = encode(self._posted)
            if len(data) > self.WIDTH - 4:
                raise DistError(f"this node's exchange address {self._posted[1]!r} is too long to trade")
            row = np.zeros(self.WIDTH, np.uint8)
            row[:4] = np.frombuffer(np.int32(len(data)).tobytes(), np.uint8)
            row[4:4 + len(data)] = np.frombuffer(data, np.uint8)
            rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, self.WIDTH)
            read = Reader(tuple[str, str])
            self._book = dict(read(r[4:4 + int(r[:4].view(np.int32)[0])].tobytes()) for r in rows)
        return self._book[key]


class ZmqGather:
    """All-gather of one message (bytes) per node and iteration over ZeroMQ, the per-step exchange's
    transport: each node binds one PULL socket and keeps a PUSH socket to every other node's, so an
    exchange is one send to each other node and one receive from each (a single hop; the runtime's
    key-value store costs a gRPC round trip to node 0 per call, JAX's gloo all-gather several thread hand-offs:
    docs/multihost.md measures the three). The sockets' addresses are traded once through the store.
    A node can be at most one iteration ahead of another (it waits for everyone's message of this one), so
    a message for the next iteration is kept until then. A node silent for `timeout_s` raises PeerFailure.
    """

    def __init__(self, nnodes: int, node_rank: int, timeout_s: float, client, coordinator_host: str, *,
                 init_timeout_s: float = 300.0, prefix: str = "jaxdp"):
        import zmq

        self.nnodes, self.node_rank, self.timeout_s = nnodes, node_rank, timeout_s
        self.ctx = zmq.Context(io_threads=1)
        host = _reachable_address(coordinator_host)
        url_host = f"[{host}]" if ":" in host else host
        self.pull = self._socket(zmq.PULL)
        port = self.pull.bind_to_random_port(f"tcp://{url_host}")
        client = client or CollectiveAddressBook()
        client.key_value_set(f"{prefix}/zmq/n{node_rank}", f"tcp://{url_host}:{port}")
        self.push, self.monitors, self.connected = {}, {}, {}
        for node in range(nnodes):
            if node != node_rank:
                try:
                    addr = client.blocking_key_value_get(f"{prefix}/zmq/n{node}", int(init_timeout_s * 1000))
                except Exception as e:
                    raise PeerFailure(f"node {node} did not post its exchange address within {init_timeout_s:.0f} s "
                                      f"({_short(e)})") from None
                self.push[node] = self._socket(zmq.PUSH)
                self.monitors[node] = self.push[node].get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                                                         | zmq.EVENT_DISCONNECTED)
                self.push[node].connect(addr)
        self.seq = 0
        self._next: dict[int, bytes] = {}  # messages of the next iteration from nodes already there

    def _socket(self, kind: int):
        import zmq

        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def __call__(self, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Every node's payload of this iteration, in node order; waits up to `timeout_s` (default: the
        exchange's) for the others'."""
        import zmq

        header = struct.pack("<qi", self.seq, self.node_rank)
        for node, sock in self.push.items():
            try:
                sock.send_multipart([header, payload], flags=zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: it has not read for many iterations
                raise PeerFailure(f"node {node} stopped reading the step exchange (#{self.seq}): it died or "
                                  "stopped") from None
        got, self._next = self._next, {}
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while len(got) < self.nnodes - 1:
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0 or not self.pull.poll(left_ms):
                missing = ", ".join(f"node {k}" for k in self.push if k not in got)
                raise PeerFailure(f"no answer from {missing} to the step exchange #{self.seq} within "
                                  f"{timeout_s:.0f} s: it died or stopped")
            head, body = self.pull.recv_multipart()
            seq, node = struct.unpack("<qi", head)
            if node not in self.push or seq not in (self.seq, self.seq + 1):  # not one of this world's nodes
                log.warning("dropped a step-exchange frame from node %d for #%d (expected #%d)", node, seq, self.seq)
                continue
            (got if seq == self.seq else self._next)[node] = body
        self.seq += 1
        return [payload if k == self.node_rank else got[k] for k in range(self.nnodes)]

    def lost(self, wait_s: float) -> list[int]:
        """The nodes whose connection dropped (read from the sockets' monitors, waiting up to `wait_s` for the
        first such news): after a failed collective, which node died."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        deadline = time.monotonic() + wait_s
        while True:
            for node, mon in self.monitors.items():
                while mon.poll(0):
                    self.connected[node] = recv_monitor_message(mon)["event"] != zmq.EVENT_DISCONNECTED
            gone = [k for k in self.monitors if self.connected.get(k) is False]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.05)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _reachable_address(coordinator_host: str) -> str:
    """This machine's address on the interface that reaches node 0 (what the other nodes can connect to)."""
    family = socket.AF_INET6 if ":" in coordinator_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((coordinator_host, 9))  # a UDP "connect" only picks the route; nothing is sent
            return s.getsockname()[0]
    except OSError as e:
        raise DistError(f"node 0's address {coordinator_host!r} is not reachable from here ({e.strerror}); "
                        "check --dist-init-addr") from None


class StoreGather:
    """The same all-gather through a key-value store such as the runtime's (a set, then a blocking get per other
    node): how the exchange went before, kept to test without processes. Keys live in
    directories of BLOCK iterations, which node 0 deletes once every node is past."""

    BLOCK = 64

    def __init__(self, nnodes: int, node_rank: int, timeout_s: float, client, prefix: str = "jaxdp/g"):
        self.nnodes, self.node_rank, self.timeout_s = nnodes, node_rank, timeout_s
        self.client, self.prefix, self.seq = client, prefix, 0

    def _key(self, seq: int, node: int) -> str:
        return f"{self.prefix}/b{seq // self.BLOCK}/x{seq}/n{node}"

    def __call__(self, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self.client.key_value_set_bytes(self._key(self.seq, self.node_rank), payload)
        out = []
        for node in range(self.nnodes):
            if node == self.node_rank:
                out.append(payload)
                continue
            try:
                out.append(self.client.blocking_key_value_get_bytes(self._key(self.seq, node),
                                                                    int(timeout_s * 1000)))
            except Exception as e:
                raise PeerFailure(f"no answer from node {node} to the step exchange #{self.seq} within "
                                  f"{timeout_s:.0f} s ({_short(e)}): it died or stopped") from None
        # every node has posted this iteration, so every node has read all keys of the ones before it
        if self.node_rank == 0 and self.seq % self.BLOCK == 0 and self.seq > 0:
            try:
                self.client.key_value_delete(f"{self.prefix}/b{self.seq // self.BLOCK - 1}")
            except Exception:  # the coordinator is going away; the next exchange reports it
                pass
        self.seq += 1
        return out

    def close(self) -> None:
        pass


def load_frame(read, raw: bytes, node: int):
    """Another node's frame of the exchange, read by `read` (`jaxdp.engine.ipc.messages.frame_reader`); anything
    else is a PeerFailure in one sentence."""
    try:
        return read(raw)
    except WireError as e:
        raise PeerFailure(f"node {node} sent a message that is not the exchange's ({e}); check that every node "
                          "runs the same jaxdp and that nothing else can reach --dist-init-addr's ports") from None


class HostExchange:
    """The agreement's exchange across nodes: every iteration each node sends the others its own ranks'
    proposals and a message (one frame of `jaxdp.engine.ipc.messages`' codec), and receives theirs; all return the
    same full list of proposals and all messages. Every node sends messages of one type, and reads the others'
    as that type (a `NodeMessage` in the engine). `gather` moves the bytes (default: `ZmqGather`, its sockets'
    addresses traded once through `client`, a key-value store, by default `CollectiveAddressBook`;
    `StoreGather` uses a store for every message). `coordinator_host`: node 0's host (--dist-init-addr's), to
    find the interface the others reach this node on.
    """

    def __init__(self, nnodes: int, node_rank: int, dp: int, timeout_s: float, *, init_timeout_s: float = 300.0,
                 client=None, gather=None, prefix="jaxdp", coordinator_host: str | None = None):
        if dp % nnodes:
            raise DistError(f"{dp} DP ranks do not split evenly over --nnodes {nnodes}")
        self.nnodes, self.node_rank, self.dp, self.timeout_s = nnodes, node_rank, dp, timeout_s
        self.init_timeout_s = init_timeout_s
        self.per_node = dp // nnodes
        if gather is None and coordinator_host is None:
            raise ValueError("HostExchange needs the coordinator's host (or a gather of its own)")
        self.gather = gather or ZmqGather(nnodes, node_rank, timeout_s, client, coordinator_host,
                                          init_timeout_s=init_timeout_s, prefix=prefix)
        self._readers: dict[type, object] = {}
        self._name_reader = None

    def lost_nodes(self, wait_s: float = 2.0) -> list[int]:
        """The other nodes known to be gone (an empty list when the transport cannot tell)."""
        lost = getattr(self.gather, "lost", None)
        return lost(wait_s) if lost else []

    def local_ranks(self, node: int | None = None) -> range:
        node = self.node_rank if node is None else node
        return range(node * self.per_node, (node + 1) * self.per_node)

    def exchange(self, proposals: list, message, timeout_s: float | None = None) -> tuple[list, list]:
        mine = self.local_ranks()
        read = self._readers.get(type(message))
        if read is None:
            read = self._readers[type(message)] = frame_reader(type(message))
        payloads = self.gather(encode((proposals[mine.start:mine.stop], message)), timeout_s)
        full, messages = list(proposals), []
        for node, raw in enumerate(payloads):
            if node == self.node_rank:
                messages.append(message)
                continue
            theirs, msg = load_frame(read, raw, node)
            r = self.local_ranks(node)
            if len(theirs) != len(r):
                raise PeerFailure(f"node {node} sent {len(theirs)} proposals for its {len(r)} ranks; check that every "
                                  "node runs with the same --mesh and --nnodes")
            full[r.start:r.stop] = theirs
            messages.append(msg)
        return full, messages

    def barrier(self, name: str, timeout_s: float) -> None:
        """Wait for every node (after start-up compiles, which take different times on different nodes): one
        round of the exchange, with `timeout_s` to wait, in which every node names the same barrier."""
        self._name_reader = self._name_reader or Reader(str)
        try:
            payloads = self.gather(encode(name), timeout_s)
            names = [load_frame(self._name_reader, raw, node) for node, raw in enumerate(payloads)]
        except PeerFailure as e:
            raise PeerFailure(f"not every node reached '{name}' within {timeout_s:.0f} s ({e})") from None
        if any(other != name for other in names):
            raise PeerFailure(f"the nodes are out of step: this node waits at '{name}', the others at {names}")


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
