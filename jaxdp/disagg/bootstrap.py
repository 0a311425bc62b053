"""The prefill server's bootstrap endpoint: what a decode server asks before it takes a request's KV.

SGLang's router sends each request to a prefill and a decode server at once, with `bootstrap_host`,
`bootstrap_port` (the prefill server's `--disaggregation-bootstrap-port`) and `bootstrap_room` (a random
63-bit integer naming the request on both). The decode server then asks the prefill server's bootstrap
endpoint, over HTTP with JSON:

- `GET /disagg/info`: the prefill server's model, KV format (`jaxdp.disagg.kv.KVFormat`), DP size and
  transfer backend and address, so a decode server of another model or cache layout is refused in one
  sentence before anything moves;
- `GET /disagg/rooms/{room}?wait=S`: waits up to S seconds for the room's prompt to be read; answers
  `{"status": "ready", "rank", "n_tokens", "first_token", "first_logprob", "address"}` once its KV is offered
  (`address`: the transfer server offering it; on a prefill server of several nodes, the node whose rank read
  the prompt, whose room reached node 0's endpoint through the node exchange),
  `{"status": "failed", "error": sentence}` if the prefill side refused or lost it, or `{"status": "pending"}`;
- `POST /disagg/rooms/{room}/taken`: the decode server pulled the room's KV (so the prefill side counts its
  offers in flight: SGLang's `num_prefill_inflight_queue_reqs`).

The board keeps each room's answer for `keep_s` seconds (a decode server that never asks costs nothing after
that; the KV offered with it is dropped by the transport after its own timeout, and counted as dropped).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI


@dataclasses.dataclass
class PrefillInfo:
    model: str  # the served model's fingerprint (config and weights' names)
    kv: dict  # KVFormat.to_json()
    dp: int
    backend: str
    address: str


class RoomBoard:
    """Rooms' outcomes on the prefill side, published by its engine, awaited by decode servers' requests."""

    def __init__(self, keep_s: float = 300.0):
        self.keep_s = keep_s
        self._rooms: dict[int, tuple[float, dict]] = {}
        self._untaken: dict[int, tuple[float, int]] = {}  # rooms offered and not yet taken: (when, rank)
        self._dropped: dict[int, int] = {}  # by rank: offers that expired untaken
        self._cond = threading.Condition()

    def _expire(self, now: float) -> None:
        self._rooms = {r: v for r, v in self._rooms.items() if now - v[0] < self.keep_s}
        for room, (t, rank) in list(self._untaken.items()):
            if now - t >= self.keep_s:
                del self._untaken[room]
                self._dropped[rank] = self._dropped.get(rank, 0) + 1

    def publish(self, room: int, outcome: dict) -> None:
        with self._cond:
            now = time.monotonic()
            self._expire(now)
            self._rooms[int(room)] = (now, outcome)
            if outcome.get("status") == "ready":
                self._untaken[int(room)] = (now, int(outcome.get("rank", 0)))
            self._cond.notify_all()

    def take(self, room: int) -> None:
        """A decode server pulled the room's KV."""
        with self._cond:
            self._untaken.pop(int(room), None)

    def inflight(self, rank: int) -> tuple[int, int]:
        """The rank's offers not yet taken, and those dropped untaken so far."""
        with self._cond:
            self._expire(time.monotonic())
            return sum(r == rank for _, r in self._untaken.values()), self._dropped.get(rank, 0)

    def wait(self, room: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while int(room) not in self._rooms:
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"status": "pending"}
                self._cond.wait(left)
            return self._rooms[int(room)][1]


def bootstrap_app(info: PrefillInfo, board: RoomBoard, max_wait_s: float = 30.0) -> FastAPI:
    app = FastAPI(title="jaxdp bootstrap")

    @app.get("/disagg/info")
    def get_info() -> dict:
        return dataclasses.asdict(info)

    @app.get("/disagg/rooms/{room}")
    def get_room(room: int, wait: float = 0.0) -> dict:  # (a plain def: FastAPI runs it on its thread pool)
        return board.wait(room, min(max(wait, 0.0), max_wait_s))

    @app.post("/disagg/rooms/{room}/taken")
    def taken(room: int) -> dict:
        board.take(room)
        return {"status": "ok"}

    return app


class BootstrapServer:
    """The bootstrap endpoint on its own port, served by uvicorn on a thread of this process."""

    def __init__(self, info: PrefillInfo, board: RoomBoard, host: str, port: int):
        config = uvicorn.Config(bootstrap_app(info, board), host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="jaxdp-bootstrap", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the bootstrap endpoint could not listen on {host}:{port}; choose another "
                              f"--disaggregation-bootstrap-port")
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)


class BootstrapClient:
    """A decode server's view of prefill servers' bootstrap endpoints (their info cached per endpoint)."""

    def __init__(self, timeout_s: float = 5.0):
        self._http = httpx.Client(timeout=timeout_s)
        self._info: dict[str, PrefillInfo] = {}

    def info(self, host: str, port: int) -> PrefillInfo:
        url = f"http://{host}:{port}"
        if url not in self._info:
            try:
                r = self._http.get(f"{url}/disagg/info")
                r.raise_for_status()
            except httpx.HTTPError as e:
                raise ConnectionError(f"no prefill server answers at bootstrap {host}:{port} ({type(e).__name__}); "
                                      f"check the request's bootstrap_host and bootstrap_port") from None
            self._info[url] = PrefillInfo(**r.json())
        return self._info[url]

    def room(self, host: str, port: int, room: int, wait_s: float) -> dict:
        try:
            r = self._http.get(f"http://{host}:{port}/disagg/rooms/{int(room)}", params={"wait": wait_s},
                               timeout=wait_s + 5)
            r.raise_for_status()
        except httpx.HTTPError as e:
            return {"status": "failed", "error": f"the prefill server at bootstrap {host}:{port} stopped answering "
                                                 f"({type(e).__name__})"}
        return r.json()

    def taken(self, host: str, port: int, room: int) -> None:
        """Tell the prefill server the room's KV was pulled (its count of offers in flight; best effort)."""
        try:
            self._http.post(f"http://{host}:{port}/disagg/rooms/{int(room)}/taken", timeout=5)
        except httpx.HTTPError:
            pass  # (the prefill server counts the offer as dropped when it expires)

    def close(self) -> None:
        self._http.close()
