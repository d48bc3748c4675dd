"""Graceful shutdown: on SIGTERM or SIGINT uvicorn stops listening and drains; past the grace period the engine
is closed, so what still runs ends with finish_reason "abort" and streams end with [DONE], not a cut."""

from __future__ import annotations

import asyncio
import signal

import uvicorn
from fastapi import FastAPI

from minigpt.async_llm.async_engine import AsyncLLM
from minigpt.server.connections import uvicorn_config

# uvicorn's own cancel of the tasks still open, a backstop once the engine has ended every request
BACKSTOP_SECONDS = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, grace: float) -> None:
        super().__init__(config)
        self.llm = llm
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.grace, lambda: loop.run_in_executor(None, self.llm.close))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def serve(app: FastAPI, llm: AsyncLLM, host: str, port: int, log_level: str, grace: float, read_timeout: float,
          limit_concurrency: int) -> None:
    """Serve `app` until SIGTERM or SIGINT, then drain for up to `grace` seconds; returns normally."""
    config = uvicorn_config(app, host, port, log_level, read_timeout, limit_concurrency, grace + BACKSTOP_SECONDS)
    # uvicorn raises the signal it drained on once more as it returns: by then it only means a clean exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    DrainingServer(config, llm, grace).run()
