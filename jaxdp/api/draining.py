"""uvicorn's server with a graceful shutdown: on SIGTERM (or Ctrl-C) it drains first
(`ServerContext.drain`: 503 for new requests, those in flight finish up to --graceful-shutdown-timeout,
the rest end with an error their clients see), then stops, and `run()` returns normally so the process
exits 0 instead of re-raising the signal. A second signal stops at once."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from jaxdp.api.context import ServerContext

log = logging.getLogger("jaxdp.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext):
        super().__init__(config)
        self.ctx = ctx
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self.drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler (uvicorn installs it for SIGINT and SIGTERM); never re-raised."""
        if self.draining or self.loop is None:
            self.should_exit = self.force_exit = True
            return
        log.info("received %s: draining", signal.Signals(sig).name)
        self.draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain() -> None:
            try:
                await self.ctx.drain()
            finally:
                self.should_exit = True

        self.drain_task = self.loop.create_task(drain())
