"""Stop strings matched as text arrives by one Aho-Corasick automaton per list of stop strings, shared by the
sequences that have that list; a sequence keeps only its state (an int)."""

from __future__ import annotations

import functools
from collections import deque


class StopStrings:
    """A state is a prefix of some stop string (0: empty). Per state: `match`, the longest stop string the text
    ends with (0: none); `held`, the longest end of the text that may still grow into one (held back)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        depth, self.match = [0], [0]
        for stop in stops:
            state = 0
            for char in stop:
                if char not in self._goto[state]:
                    self._goto.append({})
                    depth.append(depth[state] + 1)
                    self.match.append(0)
                    self._goto[state][char] = len(self._goto) - 1
                state = self._goto[state][char]
            self.match[state] = len(stop)
        self._fail = [0] * len(self._goto)
        self.held = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:  # breadth first: a state's fallback is shallower, so already complete
            state = queue.popleft()
            fallback = self._fail[state]
            if not self.match[state]:
                self.match[state] = self.match[fallback]
            self.held[state] = depth[state] if self._goto[state] else self.held[fallback]
            for char, child in self._goto[state].items():
                self._fail[child] = self._step(fallback, char)
                queue.append(child)

    def _next(self, state: int, char: str) -> int | None:
        return self._goto[state].get(char)

    def _step(self, state: int, char: str) -> int:
        while (following := self._next(state, char)) is None and state:
            state = self._fail[state]
        return 0 if following is None else following

    def scan(self, state: int, text: str, find: bool = True) -> tuple[int, int | None]:
        """(state, start in `text` of the first stop string completed, negative if it began before) with
        `find`; else (the state after `text`, None)."""
        for index, char in enumerate(text):
            state = self._step(state, char)
            if find and self.match[state]:
                return state, index + 1 - self.match[state]
        return state, None


@functools.lru_cache(maxsize=64)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    return StopStrings(stops)
