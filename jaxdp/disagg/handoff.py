"""The two ends of a request's hand-off, as an engine uses them (`--disaggregation-mode prefill|decode`).

`PrefillSide` (in the prefill server's engine process, beside its devices): starts the transfer server and the
bootstrap endpoint; when a request's prompt is read and its first token sampled, `hand_off` reads its KV from
the rank's pages, offers it under the request's bootstrap room and announces the room (its rank, length, first
token); the pages can go back to the pool at once, the offered copy is dropped by the transport after
`offer_timeout_s` if no decode server takes it. `refuse` announces a room that will not come (the prompt was
refused or failed), so the decode side ends that request at once instead of waiting out its timeout.

`DecodeSide` (in the decode server's engine process): `fetch` (on a worker thread, never the engine loop)
asks the prefill server's bootstrap endpoint for its model and KV format, refuses a prefill server of another
model or cache in one sentence, waits for the room, and pulls the KV onto a device of the decode rank; the
engine loop then `write`s it into its pool at the pages it allocated (between steps) and starts decoding from
the first token. Every failure is a `HandoffError` whose message is the one sentence the request ends with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

import jax

from jaxdp.disagg.bootstrap import BootstrapClient, BootstrapServer, PrefillInfo, RoomBoard
from jaxdp.disagg.kv import KVFormat, read_request_kv, write_request_kv
from jaxdp.disagg.transfer import TransferError, make_transport


class HandoffError(RuntimeError):
    """A request's KV could not be handed over; the message is one sentence for its client. `stage`: where
    it failed, "bootstrap" (before the pull: the prefill server, its model, the room) or "transfer" (the
    pull), as SGLang counts them (`num_bootstrap_failed_reqs_total`, `num_transfer_failed_reqs_total`)."""

    def __init__(self, sentence: str, stage: str = "bootstrap"):
        super().__init__(sentence)
        self.stage = stage


def model_fingerprint(config: dict, name: str = "") -> str:
    """What two servers must share to hand KV over: the model's architecture (its config.json fields) and name."""
    text = json.dumps(config, sort_keys=True, default=str) + "|" + name
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclasses.dataclass(frozen=True)
class Arrived:
    """A request's KV on the decode side, ready to be written into the pool."""

    room: int
    n_tokens: int
    first_token: int
    first_logprob: float
    chunks: list
    fmt: KVFormat
    seconds: float  # from asking the bootstrap endpoint to the last byte
    nbytes: int
    bootstrap_s: float = 0.0  # of which: until the room was ready (the prompt's reading, seen from here)
    pull_s: float = 0.0  # of which: the pull, from asking for the arrays to the last byte


class PrefillSide:
    """`publish`: where a room's outcome goes (`publish(room, outcome)`). None (one node, or node 0 of several):
    this process's bootstrap endpoint, started here on `bootstrap_port`; on the other nodes of a prefill server,
    the engine carries it to node 0's endpoint in the node exchange (`jaxdp.engine.step.pd_sides`). Either way the
    outcome names this process's transfer server, which offers the KV of the ranks whose pages are here."""

    def __init__(self, fmt: KVFormat, dp: int, fingerprint: str, *, backend: str = "jax", host: str = "127.0.0.1",
                 bootstrap_port: int, offer_timeout_s: float = 300.0, publish=None, dcp_size: int = 1):
        self.fmt, self.offer_timeout_s, self.dcp_size = fmt, offer_timeout_s, dcp_size  # (dcp_size: the pool's)
        self.transport = make_transport(backend, host=host)
        self.board = RoomBoard(keep_s=offer_timeout_s)
        self.server = None
        if publish is None:
            info = PrefillInfo(fingerprint, fmt.to_json(), dp, self.transport.name, self.transport.address())
            self.server = BootstrapServer(info, self.board, host, bootstrap_port)
            publish = self.board.publish
        self.publish = publish
        self.offered_bytes = 0

    def hand_off(self, cache: dict, room: int, rank: int, pages: list[int], n_tokens: int, first_token: int,
                 first_logprob: float) -> None:
        """Offer a request's KV (its first n_tokens at `rank`'s `pages` of pool `cache`) and announce the room.
        Only dispatches the read: the caller may free the pages and run the next step at once."""
        chunks = read_request_kv(cache, rank, pages, n_tokens, self.fmt, dcp=self.dcp_size)
        ticket = self.transport.offer(room, chunks, self.offer_timeout_s)
        self.offered_bytes += self.fmt.nbytes(n_tokens)
        self.publish(room, {"status": "ready", "rank": rank, "n_tokens": n_tokens, "ticket": ticket,
                            "address": self.transport.address(), "first_token": int(first_token),
                            "first_logprob": float(first_logprob)})

    def refuse(self, room: int, sentence: str) -> None:
        self.publish(room, {"status": "failed", "error": sentence})

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


class DecodeSide:
    """`dcp_size`: this server's --dcp-size (its pool split token-wise over each group's devices when > 1); the
    prefill server's pool may be split or not, the KV travels in one format either way (`jaxdp.disagg.kv`)."""

    def __init__(self, fmt: KVFormat, fingerprint: str, *, backend: str = "jax", host: str = "127.0.0.1",
                 timeout_s: float = 60.0, dcp_size: int = 1):
        self.fmt, self.fingerprint, self.timeout_s, self.dcp_size = fmt, fingerprint, timeout_s, dcp_size
        self.transport = make_transport(backend, host=host)
        self.client = BootstrapClient()

    def fetch(self, host: str, port: int, room: int, n_tokens: int, device: jax.Device) -> Arrived:
        """The KV of `room` from the prefill server at bootstrap host:port, on `device`; HandoffError otherwise."""
        t0 = time.monotonic()
        try:
            info = self.client.info(host, port)
        except ConnectionError as e:
            raise HandoffError(str(e)) from None
        if info.model != self.fingerprint:
            raise HandoffError(f"the prefill server at bootstrap {host}:{port} serves another model than this decode "
                               "server; give both the same --model-path")
        if info.backend != self.transport.name:
            raise HandoffError(f"the prefill server at bootstrap {host}:{port} hands KV over with "
                               f"--disaggregation-transfer-backend {info.backend}, this decode server with "
                               f"{self.transport.name}; give both the same")
        fmt = KVFormat.from_json(info.kv)
        why = fmt.mismatch(KVFormat(self.fmt.entries, fmt.chunk_tokens))
        if why:
            raise HandoffError(why)
        outcome = {"status": "pending"}
        while outcome["status"] == "pending" and (left := self.timeout_s - (time.monotonic() - t0)) > 0:
            outcome = self.client.room(host, port, room, wait_s=left)  # (the endpoint answers within its own cap)
        if outcome["status"] == "pending":
            raise HandoffError(f"the prefill server at bootstrap {host}:{port} did not finish bootstrap room {room} "
                               f"within {self.timeout_s:g} s")
        if outcome["status"] != "ready":
            raise HandoffError(outcome.get("error") or f"the prefill server refused bootstrap room {room}")
        if outcome["n_tokens"] != n_tokens:
            raise HandoffError(f"the prefill server read {outcome['n_tokens']} prompt tokens for bootstrap room {room} "
                               f"but this server has {n_tokens}; give both servers the same tokenizer")
        t1 = time.monotonic()
        left = max(self.timeout_s - (t1 - t0), 1.0)
        try:
            specs = fmt.specs(n_tokens, jax.sharding.SingleDeviceSharding(device))
            address = outcome.get("address") or info.address  # (the node whose rank read the prompt)
            chunks = self.transport.fetch(address, room, specs, left, outcome.get("ticket"))
        except TransferError as e:
            raise HandoffError(str(e), "transfer") from None
        except Exception as e:  # noqa: BLE001 (the transfer library's own errors: connecting to a server gone)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise HandoffError(f"the KV of bootstrap room {room} could not be pulled from the prefill server at "
                               f"bootstrap {host}:{port}: {first}", "transfer") from None
        t2 = time.monotonic()
        self.client.taken(host, port, room)
        return Arrived(room, n_tokens, outcome["first_token"], outcome["first_logprob"], chunks, fmt,
                       t2 - t0, fmt.nbytes(n_tokens), t1 - t0, t2 - t1)

    def write(self, cache: dict, rank: int, pages: list[int], arrived: Arrived) -> dict:
        """The pool with the request's KV at `rank`'s `pages` (on the engine loop, between steps)."""
        return write_request_kv(cache, rank, pages, arrived.n_tokens, arrived.fmt, arrived.chunks, dcp=self.dcp_size)

    def close(self) -> None:
        self.client.close()
