"""Stop strings matched as text arrives: one Aho-Corasick automaton over a request's stop strings, so each
character of output costs the same however many stop strings the request has.

A sequence keeps only its place in the automaton (an int); the automaton is built once per list of stop
strings and shared by every sequence that has that list.
"""

from __future__ import annotations

import functools
from collections import deque


class StopStrings:
    """The automaton of a list of stop strings. Each state is a prefix of some stop string (state 0: the
    empty one); after reading a text, the state is the longest end of the text that is such a prefix.

    Per state: `match`, the length of the longest stop string the text read now ends with (0: none), and
    `held`, the length of the longest end of the text that may still grow into a stop string (what a
    stream holds back)."""

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
        """The state after `char`, if the prefix of `state` goes on with it."""
        return self._goto[state].get(char)

    def _step(self, state: int, char: str) -> int:
        while (following := self._next(state, char)) is None and state:
            state = self._fail[state]
        return 0 if following is None else following

    def scan(self, state: int, text: str, find: bool = True) -> tuple[int, int | None]:
        """Read `text` from `state`. With `find`, stop at the first stop string that the text completes:
        (that state, where in `text` the stop string starts, negative when it began before `text`); else
        (the state after `text`, None)."""
        for index, char in enumerate(text):
            state = self._step(state, char)
            if find and self.match[state]:
                return state, index + 1 - self.match[state]
        return state, None


@functools.lru_cache(maxsize=64)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The automaton of `stops`, built once for the sequences of a request (and of requests alike)."""
    return StopStrings(stops)
