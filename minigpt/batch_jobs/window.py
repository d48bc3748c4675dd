"""A counting semaphore whose acquirers take several units at once and are served in arrival order, so a
request of many prompts is never starved by a stream of one-prompt requests behind it."""

from __future__ import annotations

import asyncio
from collections import deque


class Window:
    """`acquire(k)` waits until k units are free and earlier acquirers served; k capped at `size`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, units: int) -> int:
        """Take min(units, size) units; returns how many, for `release`."""
        units = min(units, self.size)
        if not self._waiters and self.free >= units:
            self.free -= units
            return units
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((units, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted as it was cancelled: give the units back
                self.release(units)
            else:
                self._waiters.remove((units, future))
                self._wake()
            raise
        return units

    def release(self, units: int) -> None:
        self.free += units
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            units, future = self._waiters.popleft()
            self.free -= units
            future.set_result(None)
