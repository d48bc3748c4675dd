"""Stop strings: the automaton finds what a brute-force search finds, its work per character does not grow
with the number of stop strings, and the engine bounds a request's list (max_stop_strings, max_stop_chars)."""

from __future__ import annotations

import random

import pytest

from minigpt import LLM, SamplingParams
from minigpt.engine.stop_strings import StopStrings


def first_stop(text: str, stops: list[str], begin: int) -> tuple[int, int] | None:
    """(end, start) of the stop string completed first past `begin` (the longest of those completed there),
    found by trying every end and every stop string."""
    for end in range(begin + 1, len(text) + 1):
        found = [len(stop) for stop in stops if text.endswith(stop, 0, end)]
        if found:
            return end, end - max(found)
    return None


def held_back(text: str, stops: list[str]) -> int:
    """The longest end of `text` that is a proper prefix of a stop string."""
    return max((size for stop in stops for size in range(1, len(stop)) if text.endswith(stop[:size])), default=0)


@pytest.mark.parametrize("seed", range(40))
def test_scan_matches_brute_force(seed):
    rng = random.Random(seed)
    stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
    automaton = StopStrings(tuple(stops))
    text = "".join(rng.choice("abcd") for _ in range(40))
    state, read = 0, 0
    while read < len(text):
        piece = text[read : read + rng.randint(1, 4)]  # a token's text
        state, index = automaton.scan(state, piece)
        want = first_stop(text, stops, read)
        if want is not None and want[0] <= read + len(piece):
            assert index is not None and read + index == want[1]
            return
        assert index is None
        assert automaton.held[state] == held_back(text[: read + len(piece)], stops)
        read += len(piece)


def test_ignored_matches_go_on_being_read():
    """min_tokens not reached: a completed stop string is read past; one straddling two pieces is found."""
    automaton = StopStrings(("ab", "abc"))
    state, index = automaton.scan(0, "xab", find=False)
    assert index is None and automaton.held[state] == 2  # "ab" may still grow into "abc"
    state, index = automaton.scan(state, "cab")
    assert index == -2  # "abc", begun in the piece before


def test_work_per_character_does_not_grow_with_the_list(monkeypatch):
    """Transitions tried while reading the same text: the same bound for 1 stop string and for 20,000."""
    lookups = [0]
    real = StopStrings._next

    def counted(self, state, char):
        lookups[0] += 1
        return real(self, state, char)

    monkeypatch.setattr(StopStrings, "_next", counted)
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(2000))
    counts = []
    for stops in (("zz",), tuple("".join(rng.choice("abcdefgh") for _ in range(4)) + "z" for _ in range(20000))):
        automaton = StopStrings(stops)
        lookups[0] = 0
        state = 0
        for start in range(0, len(text), 3):
            state, index = automaton.scan(state, text[start : start + 3])
            assert index is None
        counts.append(lookups[0])
    assert all(count <= 2 * len(text) for count in counts), counts  # each character: one step, one fallback


def test_engine_bounds_the_stop_list(tiny_checkpoint):
    with LLM(str(tiny_checkpoint), max_stop_strings=3, max_stop_chars=10) as llm:
        with pytest.raises(ValueError, match=r"stop has 4 strings; .* at most 3 \(max_stop_strings\)"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, stop=["a", "b", "c", "d"]))
        with pytest.raises(ValueError, match=r"stop holds 11 characters; .* at most 10 in all \(max_stop_chars\)"):
            llm.generate(["Hi"], SamplingParams(max_tokens=2, stop=["abcdef", "ghijk"]))
        assert llm.generate(["Hi"], SamplingParams(max_tokens=2, stop=["abcde", "fghij"]))[0].token_ids
