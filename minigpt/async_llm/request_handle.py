"""A submitted request as its callers see it (`RequestHandle`: deltas, result, cancel) and `StreamDelta`."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from minigpt.engine.request import EngineRequest, RequestOutput
from minigpt.sampling import TokenLogprobs


@dataclass(frozen=True)
class StreamDelta:
    """What completion `index` gained since its last delta; its deltas' text joins to its final text, its
    last has `finished=True` and the finish_reason (stop | length | abort | error)."""

    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


class RequestHandle:
    """Read a request's deltas (blocking or `async for`), wait for its output, or cancel it. Leaving an
    iteration early cancels the request: its caller has gone away."""

    def __init__(self, request: EngineRequest, cancel: Callable[[RequestHandle], None]) -> None:
        self.request_id = request.request_id
        self.request = request  # the engine thread's: read it only from there
        self._cancel = cancel
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._deltas: deque[StreamDelta] = deque()
        self._loop_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._output: RequestOutput | None = None
        self._cancelled = False
        # engine thread only: how much of each completion was handed out
        self._sent_tokens = [0] * len(request.seqs)
        self._sent_final = [False] * len(request.seqs)

    @property
    def done(self) -> bool:
        return self._output is not None

    @property
    def error(self) -> str | None:
        """Why the request failed (finish_reason "error"); None otherwise or while it runs."""
        if self._output is None:
            return None
        return next((seq.error for seq in self.request.seqs if seq.error), None)

    def cancel(self) -> None:
        with self._lock:
            if self._cancelled or self._output is not None:
                return
            self._cancelled = True
        self._cancel(self)

    # -- reading, from the callers' threads and loops ---------------------------------------------

    def __iter__(self) -> Iterator[StreamDelta]:
        try:
            while True:
                with self._ready:
                    self._ready.wait_for(lambda: self._deltas or self._output is not None)
                    if not self._deltas:
                        return
                    delta = self._deltas.popleft()
                yield delta
        finally:
            self._cancel_unless_done()

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        try:
            while True:
                with self._lock:
                    if not self._deltas and self._output is not None:
                        return
                    delta = self._deltas.popleft() if self._deltas else None
                    woken = self._register_waiter() if delta is None else None
                if delta is None:
                    await woken
                else:
                    yield delta
        finally:
            self._cancel_unless_done()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request ends; TimeoutError (the request goes on) after `timeout` seconds."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._output is not None, timeout):
                raise TimeoutError(f"request {self.request_id} still running after {timeout} s")
            return self._output

    async def wait(self) -> RequestOutput:
        """The output, without blocking the event loop; cancelling the awaiting task cancels the request."""
        try:
            while True:
                with self._lock:
                    if self._output is not None:
                        return self._output
                    woken = self._register_waiter()
                await woken
        finally:
            self._cancel_unless_done()

    def _register_waiter(self) -> asyncio.Future[None]:
        """A future the engine thread resolves at the next delivery (call with the lock held)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._loop_waiters.append((loop, future))
        return future

    def _cancel_unless_done(self) -> None:
        if self._output is None:
            self.cancel()

    # -- writing, from the engine thread ----------------------------------------------------------

    def collect(self) -> tuple[list[StreamDelta], RequestOutput | None]:
        """New tokens and text of each streamed completion since the last call; the output once finished."""
        deltas = []
        for i, seq in enumerate(self.request.seqs if self.request.streams else ()):
            if self._sent_final[i]:
                continue
            text = seq.take_text_delta()
            sent = self._sent_tokens[i]
            tokens = seq.output_token_ids[sent:]
            logprobs = seq.logprobs[sent:] if seq.logprobs is not None else None
            self._sent_tokens[i] += len(tokens)
            if text or tokens or seq.finished:
                deltas.append(StreamDelta(i, text, tokens, seq.finished, seq.finish_reason, logprobs))
                self._sent_final[i] = seq.finished
        return deltas, self.request.request_output() if self.request.finished else None

    def publish(self, deltas: list[StreamDelta], output: RequestOutput | None) -> None:
        with self._lock:
            self._deltas.extend(deltas)
            self._output = output
            self._ready.notify_all()
            waiters, self._loop_waiters = self._loop_waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_wake, future)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
