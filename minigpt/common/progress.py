"""What a user sees on stderr during long work: a one-line progress report for long batches
(requests done, tokens per second, failures and the time left), and a line for each long wait such as a compile."""

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
    """Redraws `done/total requests, tok/s[, failed][, ETA]` in place on a terminal (at most 10 times a second);
    elsewhere (a log) writes it as a line every `every` seconds. Silent unless stderr is a terminal or
    `enabled=True`, and for batches too small to need it. `total` None: a count with no end known (a job
    reading stdin). `close` shows the last update if it was held back."""

    def __init__(self, total: int | None, enabled: bool | None = None, min_total: int = 8,
                 every: float = 10.0) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty() and (total is None or total >= min_total)
        self.enabled, self.total = enabled, total
        self.terminal = sys.stderr.isatty()
        self.every = 0.1 if self.terminal else every
        self.start = time.perf_counter()
        self._written = self.start
        self._held: tuple[int, int, int | None] | None = None
        self._drawn = False

    def update(self, done: int, tokens: int, failed: int | None = None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._written < self.every and not (self.terminal and not self._drawn):
            self._held = (done, tokens, failed)
            return
        self._write(now, done, tokens, failed)

    def _write(self, now: float, done: int, tokens: int, failed: int | None) -> None:
        self._written, self._held = now, None
        elapsed = max(now - self.start, 1e-9)
        line = f"{done}/{self.total} requests" if self.total is not None else f"{done} requests"
        line += f", {tokens / elapsed:,.0f} tok/s"
        if failed is not None:
            line += f", {failed} failed"
        if self.total is not None and 0 < done < self.total:
            line += f", ETA {clock(elapsed * (self.total - done) / done)}"
        if self.terminal:
            sys.stderr.write(f"\r{PREFIX}{line} ")
            self._drawn = True
        else:
            sys.stderr.write(f"{PREFIX}{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._held is not None and self.terminal:
            self._write(time.perf_counter(), *self._held)
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def clock(seconds: float) -> str:
    """A duration as h:mm:ss (m:ss under an hour)."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
