"""API key and body checks (size, time) as ASGI middleware: they run before anything reads the body, the key
first, so a client without it cannot make the server buffer a body."""

from __future__ import annotations

import asyncio
import hmac
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minigpt.server.errors import APIError

API_KEY = re.compile(r"[\x21-\x7e]+")  # what a client can send after "Bearer ": visible ASCII, no spaces


def check_api_key(api_key: str) -> None:
    """ValueError unless `api_key` is a key a client can send (an empty one would let `Bearer ` in)."""
    if not API_KEY.fullmatch(api_key):
        raise ValueError("an API key must be 1 or more visible ASCII characters, without spaces"
                         + (" (it is empty)" if not api_key else ""))


class BearerAuth:
    """Paths under `prefix` (one or a tuple) need `Authorization: Bearer <api_key>`; probes (/health,
    /metrics) do not."""

    def __init__(self, app: ASGIApp, api_key: str, prefix: str | tuple[str, ...] = "/v1") -> None:
        self.app = app
        self.key = api_key.encode()
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix) and not self._authorized(scope):
            error = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                             "authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


class BodyLimits:
    """A body over `max_bytes` is refused (413) as soon as it is known to be; one not all arrived `timeout`
    seconds after its headers is answered 408, its connection closed."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body, more = bytearray(), True
        try:
            async with asyncio.timeout(self.timeout):
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.max_bytes:
                        await self._refuse(scope, receive, send)
                        return
        except TimeoutError:
            error = APIError(408, f"the request body did not arrive within the server's {self.timeout:g} s",
                             code="request_timeout", headers={"Connection": "close"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"request body is larger than the server's limit of {self.max_bytes} bytes",
                         code="request_too_large", headers={"Connection": "close"})
        await error.response()(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands out the buffered body once, then the client's later messages (disconnect)."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
