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
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Protocol

import jax


class TransferError(RuntimeError):
    """A request's KV did not arrive (the sentence says why)."""


class KVTransport(Protocol):
    name: str

    def address(self) -> str: ...
    def offer(self, room: int, arrays, timeout_s: float) -> None: ...
    def fetch(self, address: str, room: int, specs, timeout_s: float): ...


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
        return self._server.address()

    def offer(self, room: int, arrays, timeout_s: float) -> None:
        """Make `arrays` (a pytree of device arrays) pullable once under `room`, for `timeout_s` seconds."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self._server.await_pull(_uuid(room), arrays, timeout=deadline)

    def fetch(self, address: str, room: int, specs, timeout_s: float):
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


def _uuid(room: int) -> int:
    """The transfer id of a bootstrap room (SGLang's router draws a random 63-bit integer)."""
    return int(room) & ((1 << 63) - 1)


TRANSPORTS = {"jax": JaxTransport}


def make_transport(name: str, device: jax.Device | None = None, host: str = "127.0.0.1") -> KVTransport:
    """The transport `--disaggregation-transfer-backend` names; an unknown one is refused in a sentence."""
    if name not in TRANSPORTS:
        raise ValueError(f"--disaggregation-transfer-backend {name!r} is not available here; use one of: "
                         f"{', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name](device, host)
