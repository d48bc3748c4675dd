"""A one-line progress report on stderr for long batches: requests done and tokens per second."""

from __future__ import annotations

import sys
import time


class Progress:
    """Redraws `done/total requests, tok/s` in place; silent unless stderr is a terminal or
    `enabled=True`, and for batches too small to need it."""

    def __init__(self, total: int, enabled: bool | None = None, min_total: int = 8) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty() and total >= min_total
        self.enabled, self.total = enabled, total
        self.start = time.perf_counter()
        self._drawn = False

    def update(self, done: int, tokens: int) -> None:
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        sys.stderr.write(f"\r[minigpt] {done}/{self.total} requests, {tokens / elapsed:,.0f} tok/s ")
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
