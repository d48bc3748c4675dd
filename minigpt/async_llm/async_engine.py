"""AsyncLLM: one engine thread serving many callers, from threads or asyncio tasks, at once.

    handle = llm.submit("Hello", SamplingParams(max_tokens=32))   # any thread
    for delta in handle: ...          # or: async for delta in handle / handle.result() / await handle.wait()

Callers validate and tokenize in their own thread and drop requests into an inbox; only the engine
thread touches the engine, draining the inbox between steps and waking each handle's readers after one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Literal

import torch

from minigpt.assemble.engine import build_engine
from minigpt.async_llm.metrics import EngineMetrics, MetricsCollector
from minigpt.async_llm.request_handle import RequestHandle
from minigpt.beam.params import BeamSearchParams
from minigpt.engine.config import EngineConfig
from minigpt.engine.request import Prompt
from minigpt.sampling import SamplingParams
from minigpt.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("minigpt")


class QueueFullError(RuntimeError):
    """`max_waiting` requests already wait for the engine: retry later (a server answers 503)."""


Command = Literal["add", "cancel"]


class AsyncLLM:
    """A GPT-2 engine on its own daemon thread. `model` and `engine_args` are those of `LLM`; beyond
    max_waiting requests not yet running, `submit` raises QueueFullError."""

    def __init__(self, model: str, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs("AsyncLLM", engine_args)
        self.engine = build_engine(model, self.config)
        self._metrics = MetricsCollector(self.engine.blocks.num_blocks)
        self.engine.on_step = lambda batch, _, num_tokens: self._metrics.record_step(batch.num_seqs, num_tokens)
        self._wakeup = threading.Condition()
        self._inbox: deque[tuple[Command, RequestHandle]] = deque()
        self._closed = False
        self._active: dict[int, RequestHandle] = {}  # engine thread only
        self._step_started: float | None = None  # monotonic time of the step running now
        self._loop_error: str | None = None  # what ended the engine thread, when not close()
        self._thread = threading.Thread(target=self._run, name="minigpt-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def kv_cache_info(self) -> dict[str, int]:
        return self.engine.kv_cache_info()

    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def problem(self) -> str | None:
        """Why this engine cannot serve requests now (for a health check); None while it can."""
        if self._loop_error is not None:
            return f"the engine thread failed: {self._loop_error}"
        if not self.is_running:
            return "the engine is stopped"
        started = self._step_started
        if started is not None and time.monotonic() - started >= self.config.hung_step_seconds:
            return (f"an engine step has run for {time.monotonic() - started:.0f} s, past hung_step_seconds="
                    f"{self.config.hung_step_seconds}")
        return self.engine.runner.problem()

    def submit(self, prompt: Prompt, params: SamplingParams | BeamSearchParams | None = None) -> RequestHandle:
        """Queue a prompt to sample or beam search, as `params` says; thread-safe. Bad input raises here."""
        return self._submit(prompt, SamplingParams() if params is None else params)

    def submit_beam_search(self, prompt: Prompt, params: BeamSearchParams) -> RequestHandle:
        return self._submit(prompt, params, BeamSearchParams)

    def _submit(self, prompt: Prompt, params, kind: type | None = None) -> RequestHandle:
        self._check_open()
        request = self.engine.make_request(prompt, params, kind)
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
        return self._metrics.snapshot()

    def close(self) -> None:
        """Stop the engine thread (pending requests end with "abort") and free the KV pool; idempotent."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        self._thread.join()
        self.engine.give_back_threads()  # set in this thread, where the engine was built

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

    def _run(self) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread
                while self._serve_once():
                    pass
        except BaseException as err:
            self._loop_error = f"{type(err).__name__}: {err}"
            raise
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
        """Run one step; returns the handles with news."""
        self._step_started = time.monotonic()
        try:
            sampled = self.engine.step()
        except Exception:  # the step failed its own requests; the others go on
            logger.exception("engine step failed")
            return list(self._active.values())
        finally:
            self._step_started = None
        ids = dict.fromkeys(seq.request_id for seq in sampled)
        return [self._active[request_id] for request_id in ids if request_id in self._active]  # not yet delivered

    def _deliver(self, handles: list[RequestHandle]) -> None:
        """Update the metrics, then hand out deltas: a caller who sees its request done sees it counted."""
        news = [(handle, *handle.collect()) for handle in dict.fromkeys(handles)]
        finished = [output for _, _, output in news if output is not None]
        for output in finished:
            del self._active[output.request_id]
        self._metrics.update(self.engine.num_running_requests(), self.engine.blocks.num_used, finished)
        for handle, deltas, output in news:
            handle.publish(deltas, output)
