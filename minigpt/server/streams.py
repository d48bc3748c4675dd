"""Server-sent events and client presence: what every streaming or waiting endpoint shares."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from minigpt.async_llm.request_handle import RequestHandle, StreamDelta
from minigpt.server.errors import APIError
from minigpt.server.responses import usage

T = TypeVar("T")


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def event_stream(handles: list[RequestHandle], header: dict, include_usage: bool, opening: list[dict],
                 choice: Callable[[int, StreamDelta], dict | None]) -> StreamingResponse:
    """The chunks of `handles` as server-sent events: `opening` choices, then the choice `choice` makes of each
    (prompt index, delta) (None: nothing to send), then usage if asked, then [DONE]; the requests are cancelled
    when the stream ends or its client goes away."""
    return StreamingResponse(_events(handles, header, include_usage, opening, choice), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def _events(handles: list[RequestHandle], header: dict, include_usage: bool, opening: list[dict],
                  choice: Callable[[int, StreamDelta], dict | None]) -> AsyncIterator[str]:
    if include_usage:  # OpenAI: every chunk carries usage, null until the last
        header = {**header, "usage": None}
    try:
        for first in opening:
            yield event({**header, "choices": [first]})
        async for i, delta in merged(handles):
            if delta.finish_reason == "error":
                yield event(APIError(500, f"generation failed: {handles[i].error or 'engine error'}",
                                     "server_error").body())
                continue
            chosen = choice(i, delta)
            if chosen is not None:
                yield event({**header, "choices": [chosen]})
        if include_usage:
            yield event({**header, "choices": [], "usage": usage([await h.wait() for h in handles])})
        yield "data: [DONE]\n\n"
    finally:  # Starlette cancels this generator when the client goes away
        for handle in handles:
            handle.cancel()


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """(prompt index, delta) from every handle as soon as each arrives."""
    if len(handles) == 1:
        async for delta in handles[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for delta in handle:
                queue.put_nowait((i, delta))
        except Exception as err:
            queue.put_nowait((i, err))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # cancelling the waits cancels the engine requests
            task.add_done_callback(_read_outcome)
    return task.result() if task.done() and not task.cancelled() else None


def _read_outcome(work: asyncio.Future) -> None:
    """Take a cancelled wait's outcome: a cancelled gather() ends with a CancelledError as its exception, which
    asyncio would log, traceback and all, as never retrieved."""
    if not work.cancelled():
        work.exception()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
