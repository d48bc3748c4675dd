"""The interface every engine's adapter implements, so the bench runs each workload on each the same way."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .results import BatchResult, RequestTiming, ServingResult, StreamResult


def chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class Peer(ABC):
    """One engine. Subclasses fill in availability, preparation, batch and stream runs."""

    name: str = "peer"
    dtypes: tuple[str, ...] = ("float32",)  # what a run without --dtypes measures
    extra_dtypes: tuple[str, ...] = ()  # also accepted, measured only when named
    devices: tuple[str, ...] = ("cpu",)  # what it can run on here

    device = "cpu"  # what it runs on: set by the bench before `prepare`

    def __init__(self) -> None:
        self.dtype: str | None = None
        self.checkpoint_dir: Path | None = None

    @abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when the engine can run here, else one line saying what is missing and how to get it."""

    def available(self) -> bool:
        return self.unavailable_reason() is None

    @abstractmethod
    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        """Convert the HF checkpoint if needed (cached) and load it in ``dtype``."""

    @abstractmethod
    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> BatchResult:
        """Generate for all prompts, ``batch_size`` at a time (None: all at once)."""

    def run_one_by_one(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> BatchResult:
        """The loop a user writes without batching: one request after the other."""
        r = self.run_batch(prompts, max_new_tokens, batch_size=1)
        r.mode = "one-by-one"
        return r

    @abstractmethod
    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> StreamResult:
        """One request alone, timing its first token and the tokens after it."""

    def run_serving(self, requests: Sequence[Any], rate: float = float("nan")) -> ServingResult:
        """Serve ``workloads.ServingRequest``s as they arrive, first come first served, one at a time.

        This is what an engine without a server loop offers; llama.cpp overrides it with
        continuous batching.
        """
        result = ServingResult(self.name, self.dtype or "?", "one-at-a-time FCFS", rate)
        start = time.perf_counter()
        for req in sorted(requests, key=lambda r: r.arrival_s):
            now = time.perf_counter() - start
            if now < req.arrival_s:
                time.sleep(req.arrival_s - now)
            begin = time.perf_counter() - start
            s = self.run_stream(req.prompt.token_ids, req.max_new_tokens)
            result.requests.append(
                RequestTiming(req.arrival_s, begin + s.ttft_s, begin + s.seconds, s.prompt_tokens,
                              s.tokens_generated)
            )
        return result

    def run_static_batches(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None,
        generate: Callable[[Sequence[Sequence[int]]], list[list[int]]],
    ) -> BatchResult:
        """``generate`` (one call, one step per new token: each prompt's new ids) over ``batch_size``
        prompts at a time (None: all at once), timed."""
        bs = batch_size or len(prompts)
        outs: list[list[int]] = []
        calls = 0
        start = time.perf_counter()
        for chunk in chunks(prompts, bs):
            outs.extend(generate(chunk))
            calls += 1
        seconds = time.perf_counter() - start
        return BatchResult(
            self.name, self.dtype or "?", f"static batch {bs}", len(prompts), sum(map(len, prompts)),
            sum(map(len, outs)), seconds, calls, calls * max_new_tokens, max_new_tokens, outs,
        )

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for peers that hold nothing
        """Free the loaded model."""

    def label(self) -> str:
        return f"{self.name} {self.dtype}"
