"""Progress on stderr: a one-line report for long batches, and a line for each long wait such as a compile."""

from __future__ import annotations

import logging
import sys
import time

PREFIX = "[minigpt] "  # of every line minigpt writes to stderr


def log_to_stderr(level: int | str) -> None:
    logging.basicConfig(level=level, format=PREFIX + "%(message)s", stream=sys.stderr)


def announce(logger: logging.Logger, message: str, *args: object) -> None:
    """INFO, or straight to a terminal when logging would not show it: a wait of minutes is never silent."""
    if logger.isEnabledFor(logging.INFO) or not sys.stderr.isatty():
        logger.info(message, *args)
    else:
        sys.stderr.write(f"{PREFIX}{message % args}\n")
        sys.stderr.flush()


class Progress:
    """`done/total requests, tok/s[, failed][, ETA]`, redrawn in place on a terminal, else a line every `every`
    seconds; `total` None when unknown (stdin)."""

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
