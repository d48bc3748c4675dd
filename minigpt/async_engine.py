"""AsyncLLM: one engine thread serving many callers, from threads or asyncio tasks, at once.

    llm = AsyncLLM("gpt2")
    handle = llm.submit("Hello", SamplingParams(max_tokens=32))   # any thread, or asyncio code
    for delta in handle: ...          # or: async for delta in handle / handle.result() / await handle.wait()

`submit` validates and tokenizes in the caller's thread, then drops the request into an inbox.
The engine thread alone touches the engine (scheduler, KV pool, model): between two steps it
drains the inbox (new requests, cancellations), so requests join the running batch as they
arrive; after a step it hands each request's new tokens and text to its `RequestHandle`, whose
readers it wakes (a condition for threads, `call_soon_threadsafe` for event loops). When there
is no work the thread sleeps on a condition.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from minigpt.engine import Engine
from minigpt.engine_config import EngineConfig
from minigpt.metrics import EngineMetrics, MetricsCollector
from minigpt.request import Prompt, Request, RequestOutput
from minigpt.sampling import SamplingParams, TokenLogprobs
from minigpt.tokenizer import Tokenizer

logger = logging.getLogger("minigpt")


class QueueFullError(RuntimeError):
    """`max_waiting` requests already wait for the engine: retry later (a server answers 503)."""


@dataclass(frozen=True)
class StreamDelta:
    """What one completion (`index`, for SamplingParams.n > 1) gained since the last delta.

    `text` never ends in half a character nor in the start of a stop string that may still match;
    a completion's deltas join to its final text. The last delta of a completion has
    `finished=True` and its finish_reason: stop | length | abort | error. With
    SamplingParams.logprobs set, `logprobs` holds one TokenLogprobs per token of `token_ids`."""

    index: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


class RequestHandle:
    """A submitted request: read its deltas (blocking or `async for`), wait for its output, or cancel it.

    Deltas are consumed by whoever iterates; `result()` and `wait()` work whether or not anyone
    does. Leaving an iteration early (break, an exception, the awaiting task cancelled) cancels
    the request: its caller has gone away."""

    def __init__(self, request: Request, cancel: Callable[[RequestHandle], None]) -> None:
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
        """Ask the engine to stop this request at its next step; idempotent, any thread."""
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
        """The output, without blocking the event loop. Cancelling the awaiting task cancels the
        request too (wrap in `asyncio.shield` to keep it running)."""
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
        """New tokens and text of each completion since the last call; the output once finished."""
        deltas = []
        for i, seq in enumerate(self.request.seqs):
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
        return deltas, self.request.output() if self.request.finished else None

    def publish(self, deltas: list[StreamDelta], output: RequestOutput | None) -> None:
        """Hand `collect()`'s result to the readers and wake them."""
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


Command = Literal["add", "cancel"]


class AsyncLLM:
    """A GPT-2 engine on its own daemon thread, shared by any number of threads and asyncio tasks.

    `model` and `engine_args` are those of `LLM` (the fields of `EngineConfig`); `max_waiting`
    bounds the requests not yet running: beyond it `submit` raises QueueFullError at once.
    Also a context manager; `close()` ends pending requests with finish_reason "abort"."""

    def __init__(self, model: str, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs("AsyncLLM", engine_args)
        self.engine = Engine(model, self.config)
        self._metrics = MetricsCollector(self.engine.blocks.num_blocks)
        self.engine.on_step = lambda batch, sampled: self._metrics.record_step(len(batch.chunks), len(sampled))
        self._wakeup = threading.Condition()
        self._inbox: deque[tuple[Command, RequestHandle]] = deque()
        self._closed = False
        self._active: dict[int, RequestHandle] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="minigpt-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        """True while the engine thread serves requests (False after close() or a crash of its loop)."""
        return not self._closed and self._thread.is_alive()

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestHandle:
        """Queue a prompt (text or token ids); thread-safe. Bad input raises ValueError/TypeError here,
        a full queue QueueFullError."""
        self._check_open()
        request = self.engine.make_request(prompt, SamplingParams() if params is None else params)
        handle = RequestHandle(request, self._request_cancel)
        with self._wakeup:
            self._check_open()
            if self._metrics.num_waiting >= self.config.max_waiting:
                raise QueueFullError(f"{self.config.max_waiting} requests already wait (max_waiting); retry later")
            self._metrics.record_submit(len(request.prompt_token_ids))
            self._inbox.append(("add", handle))
            self._wakeup.notify()
        return handle

    def metrics(self) -> EngineMetrics:
        """A snapshot of the engine-wide counters (see minigpt.metrics)."""
        return self._metrics.snapshot()

    def close(self) -> None:
        """Stop the engine thread (pending requests end with "abort") and free the KV pool; idempotent."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._thread.join()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncLLM is closed")

    def _request_cancel(self, handle: RequestHandle) -> None:
        with self._wakeup:
            if not self._closed:
                self._inbox.append(("cancel", handle))
                self._wakeup.notify()

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread
                while self._serve_once():
                    pass
        finally:  # closed, or a bug in this loop: never leave a caller waiting
            with self._wakeup:
                self._closed = True
                self._active.update((h.request_id, h) for command, h in self._inbox if command == "add")
                self._inbox.clear()
            for handle in self._active.values():
                self.engine.abort(handle.request)
            self._deliver(list(self._active.values()))
            self.engine.close()

    def _serve_once(self) -> bool:
        """Take the inbox, run one step; False once closed."""
        with self._wakeup:
            self._wakeup.wait_for(lambda: self._inbox or self._closed or self.engine.has_work())
            commands, closing = list(self._inbox), self._closed
            self._inbox.clear()
        changed = []
        for command, handle in commands:
            if command == "add":
                self._active[handle.request_id] = handle
                self.engine.add(handle.request)
            elif handle.request_id in self._active:
                self.engine.abort(handle.request)
                changed.append(handle)
        if closing:
            return False
        if self.engine.has_work():
            changed += self._step()
        self._deliver(changed)
        return True

    def _step(self) -> list[RequestHandle]:
        """Run one step; returns the handles with news. A failing step fails its requests only."""
        try:
            sampled = self.engine.step()
        except Exception:  # the step failed its own requests; the others go on
            logger.exception("engine step failed")
            return list(self._active.values())
        return [self._active[request_id] for request_id in dict.fromkeys(seq.request_id for seq in sampled)]

    def _deliver(self, handles: list[RequestHandle]) -> None:
        """Update the metrics, then hand out deltas: a caller who sees its request done sees it counted."""
        news = [(handle, *handle.collect()) for handle in dict.fromkeys(handles)]
        finished = [output for _, _, output in news if output is not None]
        for output in finished:
            del self._active[output.request_id]
        self._metrics.update(self.engine.num_running_requests(), self.engine.blocks.num_used, finished)
        for handle, deltas, output in news:
            handle.publish(deltas, output)
