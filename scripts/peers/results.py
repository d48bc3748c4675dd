"""What a peer's run returns: batch, stream and serving results, and the medians over repetitions."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class BatchResult:
    """Many prompts generated to completion: throughput and the average time per decode step."""

    engine: str
    dtype: str
    mode: str  # "one-by-one", "static batch 32", "continuous 32", ...
    n_prompts: int
    prompt_tokens: int
    tokens_generated: int
    seconds: float
    calls: int  # generate calls (static/one-by-one) or model steps (continuous batching)
    steps: int  # model forward passes: calls x max_new_tokens for generate calls, decode calls otherwise
    max_new_tokens: int
    token_ids: list[list[int]] | None = None  # generated ids per prompt, for fidelity checks

    @property
    def tok_per_s(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else float("nan")

    @property
    def ms_per_step(self) -> float:
        """Wall time per model step: the per-token latency each sequence of the batch sees (seed 002)."""
        return 1000.0 * self.seconds / self.steps if self.steps else float("nan")


@dataclass
class StreamResult:
    """One request timed token by token."""

    engine: str
    dtype: str
    prompt_tokens: int
    tokens_generated: int
    ttft_s: float  # request start -> first generated token available
    tpot_s: float  # mean time between the following tokens
    seconds: float  # request start -> last token
    token_ids: list[int] | None = None

    @property
    def tok_per_s(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class RequestTiming:
    """One request of a serving run; times in seconds from the run's start."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    tokens_generated: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        n = self.tokens_generated - 1
        return (self.finish_s - self.first_token_s) / n if n > 0 else float("nan")


@dataclass
class ServingResult:
    """A Poisson-arrival run: per-request TTFT/TPOT and overall throughput."""

    engine: str
    dtype: str
    mode: str
    rate: float
    requests: list[RequestTiming] = field(default_factory=list)

    @property
    def tokens_generated(self) -> int:
        return sum(r.tokens_generated for r in self.requests)

    @property
    def seconds(self) -> float:
        return max(r.finish_s for r in self.requests) if self.requests else float("nan")

    @property
    def tok_per_s(self) -> float:
        return self.tokens_generated / self.seconds

    def summary(self) -> dict[str, float]:
        """TTFT/TPOT p50/p99 in ms and throughput."""
        from workloads import percentile  # scripts/ is on sys.path when bench.py runs

        ttft = [1000 * r.ttft_s for r in self.requests]
        tpot = [1000 * r.tpot_s for r in self.requests if r.tokens_generated > 1]
        return {
            "rate": self.rate,
            "requests": len(self.requests),
            "tok_per_s": self.tok_per_s,
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50),
            "tpot_p99_ms": percentile(tpot, 99),
        }


def mean_gap(times: Sequence[float]) -> float:
    """Mean time between the first and the last of ``times`` (the TPOT of tokens timed as they come)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


def median_batch(results: Sequence[BatchResult]) -> BatchResult:
    """The repetition with the median wall time (token counts are equal across repetitions)."""
    ordered = sorted(results, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def median_stream(results: Sequence[StreamResult]) -> StreamResult:
    """Median TTFT, TPOT and total time, each over the repetitions."""
    return replace(
        results[0],
        ttft_s=statistics.median(r.ttft_s for r in results),
        tpot_s=statistics.median(r.tpot_s for r in results),
        seconds=statistics.median(r.seconds for r in results),
    )


def repeat(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> list[Any]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times; return those results."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(repeats)]
