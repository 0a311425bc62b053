"""Moving a request's KV between servers, through an existing transfer library.

`KVTransport` is what prefill/decode disaggregation needs of one: the prefill side offers a request's
arrays under its bootstrap room; the decode side fetches them from the prefill side's address into its own
devices. `JaxTransport` is JAX's own transfer server (`jax.experimental.transfer`): device arrays on both
ends, pulled by the receiver, no host staging on GPUs; on this CPU machine about 0.5-0.7 GB/s between two
processes.

What JAX's transfer server does on failure (measured, jax 0.10.2, XLA:CPU), and what this module makes of it:
- an offer left unpulled past its deadline is dropped by the server (so a decode server that never comes
  costs the prefill side nothing after `offer_timeout_s`), but a pull of a room never offered, or offered and
  dropped, waits forever: `pull`'s own timeout does not end it. So the decode side pulls only once the
  prefill side said the room is offered (`jaxdp.disagg.bootstrap`), and waits for the arrays with its own
  deadline.
- a sender that dies mid-transfer, or arrays of another shape than asked, fail the pulled arrays with an
  error (`JaxRuntimeError`), which `fetch` turns into one sentence.

`NixlTransport` is NIXL (`pip install nixl-cu12`; 1.5.1 measured here) over UCX, on host memory: the offered
arrays are copied into one registered host buffer, the receiver READs it into its own registered buffer and
puts the arrays on its devices (on a GPU, NIXL would read device memory directly: not wired, this machine has
none). What the receiver needs besides the address (the agent's metadata) is the buffer's place and its
registration (NIXL's partial metadata): `offer` returns them as a ticket, which the prefill side publishes with
the room. The receiver's READ carries the room as
NIXL's notification, so the sender frees a buffer once taken (else after its deadline). The backend is offered
only where NIXL imports (`TRANSPORTS`): elsewhere `--disaggregation-transfer-backend nixl` is one sentence.
"""

from __future__ import annotations

import base64
import datetime
import importlib.util
import socket
import threading
import time
import uuid
from typing import Protocol

import jax
import numpy as np


class TransferError(RuntimeError):
    """A request's KV did not arrive (the sentence says why)."""


class KVTransport(Protocol):
    name: str

    def address(self) -> str: ...
    def offer(self, room: int, arrays, timeout_s: float) -> dict | None: ...  # a ticket the receiver needs, or None
    def fetch(self, address: str, room: int, specs, timeout_s: float, ticket: dict | None = None): ...


class JaxTransport:
    """JAX's transfer server on this process's devices (`start_transfer_server` on `host`, any port)."""

    name = "jax"

    def __init__(self, device: jax.Device | None = None, host: str = "127.0.0.1"):
        client = (device or jax.local_devices()[0]).client
        from jax.experimental import transfer  # (imported here: only a server in a disaggregation mode needs it)

        self._server = transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self._connections: dict[str, object] = {}
        self._lock = threading.Lock()

    def address(self) -> str:
        return advertised(self._server.address())

    def offer(self, room: int, arrays, timeout_s: float) -> None:
        """Make `arrays` (a pytree of device arrays) pullable once under `room`, for `timeout_s` seconds."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self._server.await_pull(_uuid(room), arrays, timeout=deadline)

    def fetch(self, address: str, room: int, specs, timeout_s: float, ticket: dict | None = None):
        """The arrays offered under `room` at `address`, as `specs` (a pytree of ShapeDtypeStruct with
        shardings on this process's devices); TransferError if they do not arrive within timeout_s."""
        with self._lock:
            conn = self._connections.get(address)
            if conn is None:
                conn = self._connections[address] = self._server.connect(address)
        arrays = conn.pull(_uuid(room), specs)
        deadline = time.monotonic() + timeout_s
        leaves = jax.tree.leaves(arrays)
        while not all(x.is_ready() for x in leaves):
            if time.monotonic() > deadline:
                raise TransferError(f"the KV of bootstrap room {room} did not arrive from {address} within "
                                    f"{timeout_s:g} s")
            time.sleep(0.002)
        try:
            jax.block_until_ready(arrays)
        except Exception as e:  # noqa: BLE001 (XLA's runtime error: the sender died, or the shapes differ)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TransferError(f"the KV of bootstrap room {room} from {address} failed in transfer: {first}") from None
        return arrays


def advertised(address: str) -> str:
    """The address a server bound to HOST:PORT gives to others: a wildcard host (`--host 0.0.0.0` or `::`, which
    nobody can connect to) becomes this machine's address as its hostname resolves (each node of a server of
    several publishes its own)."""
    host, _, port = address.rpartition(":")
    if host.strip("[]") not in ("0.0.0.0", "::", ""):
        return address
    try:
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return f"127.0.0.1:{port}"


def _uuid(room: int) -> int:
    """The transfer id of a bootstrap room (SGLang's router draws a random 63-bit integer)."""
    return int(room) & ((1 << 63) - 1)


def _nixl_module() -> str | None:
    """The importable NIXL package (its wheels name it `nixl_cu12`, `nixl_cu13` or `nixl`), or None."""
    return next((m for m in ("nixl_cu12", "nixl_cu13", "nixl") if importlib.util.find_spec(m) is not None), None)


class NixlTransport:
    """NIXL over UCX on host memory (see the module's docstring)."""

    name = "nixl"

    def __init__(self, device: jax.Device | None = None, host: str = "127.0.0.1"):
        module = _nixl_module()
        if module is None:
            raise ValueError("--disaggregation-transfer-backend nixl needs NIXL: pip install nixl-cu12")
        api = importlib.import_module(f"{module}._api")
        self._agent = api.nixl_agent(f"jaxdp-{uuid.uuid4().hex[:12]}", api.nixl_agent_config(backends=["UCX"]))
        self._offers: dict[int, tuple[float, np.ndarray, object]] = {}  # room -> (deadline, buffer, registration)
        self._remotes: dict[str, str] = {}  # address -> the remote agent's name
        self._lock = threading.Lock()

    def address(self) -> str:
        return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def _reap(self) -> None:
        """Free the buffers a receiver took (its READ's notification) or nobody took in time."""
        taken = {int(m) for msgs in self._agent.get_new_notifs().values() for m in msgs if m.isdigit()}
        now = time.monotonic()
        for room in [r for r, (deadline, _, _) in self._offers.items() if r in taken or now > deadline]:
            _, _, reg = self._offers.pop(room)
            self._agent.deregister_memory(reg)

    def offer(self, room: int, arrays, timeout_s: float) -> dict:
        leaves = [np.ascontiguousarray(np.asarray(x)).view(np.uint8).ravel() for x in jax.tree.leaves(arrays)]
        buf = np.concatenate(leaves) if leaves else np.zeros(1, np.uint8)
        with self._lock:
            self._reap()
            reg = self._agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
            self._offers[int(room)] = (time.monotonic() + timeout_s, buf, reg)
            md = self._agent.get_partial_agent_metadata(reg, True)  # (the buffer's registration, for the reader)
        return {"addr": int(buf.ctypes.data), "nbytes": int(buf.nbytes), "md": base64.b64encode(md).decode()}

    def fetch(self, address: str, room: int, specs, timeout_s: float, ticket: dict | None = None):
        leaves, tree = jax.tree.flatten(specs)
        sizes = [int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in leaves]
        if ticket is None or ticket.get("nbytes") != sum(sizes):
            raise TransferError(f"the KV of bootstrap room {room} was offered as {ticket and ticket.get('nbytes')} "
                                f"bytes, not the {sum(sizes)} this server expects")
        dst = np.empty(sum(sizes), np.uint8)
        with self._lock:
            remote = self._remotes.get(address)
            if remote is None:
                remote = self._remotes[address] = self._agent.add_remote_agent(base64.b64decode(address))
            self._agent.add_remote_agent(base64.b64decode(ticket["md"]))  # the offered buffer's registration
            reg = self._agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"),
                self._agent.get_xfer_descs([(ticket["addr"], ticket["nbytes"], 0)], "DRAM"), remote,
                str(int(room)).encode())
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"the KV of bootstrap room {room} did not arrive within {timeout_s:g} s")
                time.sleep(0.001)
                state = self._agent.check_xfer_state(handle)
            self._agent.release_xfer_handle(handle)
            if state != "DONE":
                raise TransferError(f"the KV of bootstrap room {room} failed in transfer (NIXL: {state})")
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 (NIXL's own errors: the sender gone)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TransferError(f"the KV of bootstrap room {room} failed in transfer: {first}") from None
        finally:
            with self._lock:
                self._agent.deregister_memory(reg)
        out, at = [], 0
        for s, n in zip(leaves, sizes, strict=True):
            host = dst[at: at + n].view(np.dtype(s.dtype)).reshape(s.shape)
            out.append(jax.device_put(host, s.sharding))
            at += n
        return jax.tree.unflatten(tree, out)


TRANSPORTS = {"jax": JaxTransport, **({"nixl": NixlTransport} if _nixl_module() else {})}


def make_transport(name: str, device: jax.Device | None = None, host: str = "127.0.0.1") -> KVTransport:
    """The transport `--disaggregation-transfer-backend` names; an unknown one is refused in a sentence."""
    if name not in TRANSPORTS:
        why = " (NIXL is not installed: pip install nixl-cu12)" if name == "nixl" else ""
        raise ValueError(f"--disaggregation-transfer-backend {name!r} is not available here{why}; use one of: "
                         f"{', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name](device, host)
