"""uvicorn's config: a deadline for each request's headers (uvicorn bounds only the idle time between requests,
so a slowloris client would hold its connection for ever) and a limit on connections and requests in flight,
past which a request gets OpenAI's error object (uvicorn's own limit answers plain text, and at the limit)."""

from __future__ import annotations

import asyncio
import functools

import uvicorn
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from minigpt.server.errors import APIError


class GuardedH11(H11Protocol):
    """One connection: its request headers under `header_timeout`, its requests refused with a 503 while more
    than `limit` connections are open or requests in flight (this one's counted)."""

    def __init__(self, *args, header_timeout: float, limit: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None
        self.limit = limit
        self.app = functools.partial(self._gate, self.app)

    async def _gate(self, app, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (len(self.connections) > self.limit or len(self.tasks) > self.limit):
            self.logger.warning("refused a request: over %d connections or requests in flight", self.limit)
            refusal = APIError(503, f"the server is over its limit of {self.limit} connections and requests in "
                               f"flight (--limit-concurrency): retry later", "server_error",
                               code="concurrency_limit", headers={"Retry-After": "1", "Connection": "close"})
            await refusal.response()(scope, receive, send)
            return
        await app(scope, receive, send)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._awaiting_headers():  # the first bytes of a request after another
            self._arm()
        super().data_received(data)
        if not self._awaiting_headers():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.logger.debug("closed a connection whose request headers took over %g s", self.header_timeout)
            self.transport.close()


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str, read_timeout: float,
                   limit_concurrency: int, graceful_timeout: float | None = None) -> uvicorn.Config:
    """The server's uvicorn config: HTTP/1.1 over h11 with `read_timeout` for a request's headers, and
    `limit_concurrency` connections and requests in flight (past it, a new request gets 503)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=functools.partial(GuardedH11, header_timeout=read_timeout, limit=limit_concurrency),
                          timeout_graceful_shutdown=graceful_timeout)
