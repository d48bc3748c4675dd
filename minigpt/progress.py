"""What a user sees on stderr during long work: a one-line progress report for long batches
(requests done and tokens per second), and a line for each long wait such as a compile."""

from __future__ import annotations

import logging
import sys
import time

PREFIX = "[minigpt] "  # every line minigpt writes to stderr: progress, waits and the CLIs' logs


def log_to_stderr(level: int | str) -> None:
    """The CLIs' logging: the engine's INFO lines (loading, compiling) on stderr, prefixed."""
    logging.basicConfig(level=level, format=PREFIX + "%(message)s", stream=sys.stderr)


def announce(logger: logging.Logger, message: str, *args: object) -> None:
    """Log `message % args` at INFO; when logging would not show it and stderr is a terminal, write
    it there instead, so that a wait of minutes (compile=True at start) never passes in silence."""
    if logger.isEnabledFor(logging.INFO) or not sys.stderr.isatty():
        logger.info(message, *args)
    else:
        sys.stderr.write(f"{PREFIX}{message % args}\n")
        sys.stderr.flush()


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
        sys.stderr.write(f"\r{PREFIX}{done}/{self.total} requests, {tokens / elapsed:,.0f} tok/s ")
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
