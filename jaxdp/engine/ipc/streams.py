"""How the loop thread tells the server's event loops about new tokens: one hop per step, not one per token.

A streaming request's `on_update` (called by the scheduler after each of its tokens and when it ends) only
notes its queue; after the step the loop thread hands each event loop all of its notes at once
(`Wakeups.deliver`), so 256 streams cost one `call_soon_threadsafe` per step instead of 256.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from jaxdp.engine.sched.request import Request


class Wakeups:
    def __init__(self):
        self._lock = threading.Lock()
        self._notes: dict[asyncio.AbstractEventLoop, list[asyncio.Queue]] = {}

    def note(self, loop: asyncio.AbstractEventLoop, updates: asyncio.Queue) -> None:
        with self._lock:
            self._notes.setdefault(loop, []).append(updates)

    def deliver(self) -> None:
        """Wake every event loop with notes once (the loop thread, after each step; and on failure)."""
        with self._lock:
            notes, self._notes = self._notes, {}
        for loop, queues in notes.items():
            try:
                loop.call_soon_threadsafe(_put_all, queues)
            except RuntimeError:  # that event loop is closed: nobody waits there any more
                pass

    async def stream(self, req: Request, submit: Callable[[Request], object],
                     abort: Callable[[str], object]) -> AsyncIterator[Request]:
        """Yield the request after every new token and once when it finishes; abort it if the caller leaves."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        req.on_update = lambda _r: self.note(loop, updates)
        submit(req)
        try:
            while True:
                await updates.get()
                while not updates.empty():  # several steps' notes at once: one yield shows them all
                    updates.get_nowait()
                yield req
                if req.finished:
                    return
        finally:
            if not req.finished:  # the client went away: free its pages
                abort(req.rid)


def _put_all(queues: list[asyncio.Queue]) -> None:
    for q in queues:
        q.put_nowait(None)


class Result:
    """A value the loop thread hands to another thread."""

    def __init__(self):
        self._event, self._value = threading.Event(), None

    def set_result(self, value) -> None:
        self._value = value
        self._event.set()

    def wait(self, timeout: float = 30):
        self._event.wait(timeout)
        return self._value
