"""Engine-wide counters of the concurrent front: what a dashboard or a /metrics endpoint shows.

The engine thread records; any thread reads a consistent `EngineMetrics` snapshot. Counters
(`*_total`, `num_steps`, the batch size histogram) only grow. Gauges (requests running and
waiting, KV blocks in use) describe the state after the last step. Time to first token and time
per output token are Prometheus histograms: cumulative counts per upper bound `le` in seconds,
the last bound +Inf, plus the sum and count of the observations. Per-request timings are in
`RequestOutput.metrics`.
"""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass, field

from minigpt.engine.request import RequestOutput

# Seconds. CPU steps of gpt2-sized models take tens to hundreds of milliseconds; GPUs a few.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, math.inf)


@dataclass
class Histogram:
    """`counts[i]` observations were <= `bounds[i]` (cumulative, as Prometheus' `le` buckets)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1


@dataclass
class EngineMetrics:
    requests_total: int = 0
    """Requests accepted by `submit` (refused ones are not counted)."""
    requests_running: int = 0
    """Requests with a sequence in the running batch."""
    requests_waiting: int = 0
    """Accepted requests neither running nor finished: requests_total = finished + running + waiting."""
    requests_finished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    """Finished requests by the finish_reason of their first completion (stop, length, abort, error)."""
    prompt_tokens_total: int = 0
    """Prompt tokens of accepted requests."""
    generation_tokens_total: int = 0
    """Tokens sampled, over every completion."""
    num_steps: int = 0
    """Model steps run (failed steps are not counted)."""
    spec_steps_total: int = 0
    """Speculative verification steps of finished requests."""
    spec_draft_tokens_total: int = 0
    """Tokens drafted for finished requests."""
    spec_accepted_tokens_total: int = 0
    """Of those, the tokens the target accepted."""
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    batch_size_histogram: dict[int, int] = field(default_factory=dict)
    """Sequences in a step (prompt chunks and decodes) -> number of steps of that size."""
    ttft_seconds: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot_seconds: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))

    def to_prometheus(self, prefix: str = "minigpt") -> str:
        """The Prometheus text exposition format of these metrics."""
        lines: list[str] = []

        def metric(name: str, kind: str, value: float, labels: str = "") -> None:
            if kind:
                lines.append(f"# TYPE {prefix}_{name} {kind}")
            lines.append(f"{prefix}_{name}{labels} {value}")

        for name in ("requests_total", "prompt_tokens_total", "generation_tokens_total", "spec_steps_total",
                     "spec_draft_tokens_total", "spec_accepted_tokens_total"):
            metric(name, "counter", getattr(self, name))
        if self.spec_draft_tokens_total:
            metric("spec_acceptance_rate", "gauge", self.spec_accepted_tokens_total / self.spec_draft_tokens_total)
            metric("spec_mean_accepted_tokens", "gauge", self.spec_accepted_tokens_total / self.spec_steps_total)
        metric("steps_total", "counter", self.num_steps)
        for name in ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_total"):
            metric(name, "gauge", getattr(self, name))
        lines.append(f"# TYPE {prefix}_requests_finished_total counter")
        for reason, n in sorted(self.finish_reasons.items()):
            metric("requests_finished_total", "", n, f'{{finish_reason="{reason}"}}')
        lines.append(f"# TYPE {prefix}_batch_size_steps_total counter")
        for size, n in sorted(self.batch_size_histogram.items()):
            metric("batch_size_steps_total", "", n, f'{{batch_size="{size}"}}')
        for name, hist in (("time_to_first_token_seconds", self.ttft_seconds),
                           ("time_per_output_token_seconds", self.tpot_seconds)):
            lines.append(f"# TYPE {prefix}_{name} histogram")
            for bound, n in zip(hist.bounds, hist.counts, strict=True):
                metric(f"{name}_bucket", "", n, f'{{le="{"+Inf" if bound == math.inf else bound}"}}')
            metric(f"{name}_sum", "", hist.sum)
            metric(f"{name}_count", "", hist.count)
        return "\n".join(lines) + "\n"


class MetricsCollector:
    """Thread-safe accumulator: the engine thread records, `snapshot` copies under the lock."""

    def __init__(self, kv_blocks_total: int) -> None:
        self._lock = threading.Lock()
        self._m = EngineMetrics(kv_blocks_total=kv_blocks_total)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return self._m.requests_waiting

    def record_submit(self, prompt_tokens: int) -> None:
        with self._lock:
            self._m.requests_total += 1
            self._m.prompt_tokens_total += prompt_tokens
            self._update_waiting()

    def record_step(self, batch_size: int, num_sampled: int) -> None:
        with self._lock:
            self._m.num_steps += 1
            self._m.generation_tokens_total += num_sampled
            hist = self._m.batch_size_histogram
            hist[batch_size] = hist.get(batch_size, 0) + 1

    def update(self, requests_running: int, kv_blocks_used: int, finished: list[RequestOutput]) -> None:
        """Gauges after a step and the requests it finished, in one update so snapshots add up."""
        with self._lock:
            m = self._m
            m.requests_running, m.kv_blocks_used = requests_running, kv_blocks_used
            for output in finished:
                m.requests_finished += 1
                reason = output.finish_reason or "unknown"
                m.finish_reasons[reason] = m.finish_reasons.get(reason, 0) + 1
                m.spec_steps_total += output.metrics.num_spec_steps
                m.spec_draft_tokens_total += output.metrics.num_draft_tokens
                m.spec_accepted_tokens_total += output.metrics.num_accepted_tokens
                if output.token_ids:
                    m.ttft_seconds.observe(output.metrics.time_to_first_token)
                if len(output.token_ids) > 1:
                    m.tpot_seconds.observe(output.metrics.time_per_output_token)
            self._update_waiting()

    def _update_waiting(self) -> None:
        m = self._m
        m.requests_waiting = m.requests_total - m.requests_finished - m.requests_running

    def snapshot(self) -> EngineMetrics:
        with self._lock:
            return copy.deepcopy(self._m)
