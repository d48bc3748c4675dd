"""uvicorn's config: a deadline for each request's headers (uvicorn bounds only the idle time between requests,
so a slowloris client would hold its connection for ever) and a limit on connections and requests in flight."""

from __future__ import annotations

import asyncio
import functools

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadline(H11Protocol):
    def __init__(self, *args, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None

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
                          http=functools.partial(HeaderDeadline, header_timeout=read_timeout),
                          limit_concurrency=limit_concurrency, timeout_graceful_shutdown=graceful_timeout)
