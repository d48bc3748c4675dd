"""The text of one sequence's output: decoded as it is read, ending before the first stop string (as OpenAI's
does), streamed in deltas that hold back a tail which may still become one. The token ids are the sequence's,
passed in: a fork's text goes on from its own."""

from __future__ import annotations

import copy

from minigpt.engine.stop_strings import stop_strings
from minigpt.tokenizer.tokenizer import IncrementalDecoder, Tokenizer


class SequenceText:
    """The detokenizer, the stop strings' automaton and the text so far of one list of output token ids."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] | None) -> None:
        self.text = ""
        self.num_decoded = 0  # output tokens in text
        self.end: int | None = None  # output tokens the text covers, where a last one is not its (None: all)
        self.flush_pending = False  # finished with the decoder's tail still to add to the text
        self.num_streamed_chars = 0
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = stop_strings(stop) if stop else None
        self.stop_state = 0  # where the text so far leaves the stop strings' automaton

    def decoded(self, ids: list[int]) -> str:
        """The text of `ids` so far, decoded up to its last token now."""
        end = len(ids) if self.end is None else self.end
        if self.num_decoded < end:
            self.text += self.decoder.feed_all(ids[self.num_decoded : end])
            self.num_decoded = end
        if self.flush_pending:
            self.text += self.decoder.flush()
            self.flush_pending = False
        return self.text

    def cut_at_stop(self, ids: list[int], find: bool) -> bool:
        """Scan the text new since the last scan; with `find`, True where a stop string completes in it (the text
        then ends before it)."""
        start = len(self.text)
        delta = self.decoded(ids)[start:]
        self.stop_state, index = self.stops.scan(self.stop_state, delta, find)
        if index is None:
            return False
        self.text = self.text[: start + index]
        return True

    def take_delta(self, ids: list[int], finished: bool) -> str:
        """Text not yet streamed, holding back (unless `finished`) a tail that may still become a stop string."""
        text = self.decoded(ids)
        end = len(text)
        if not finished and self.stops is not None:
            end -= self.stops.held[self.stop_state]
        delta = text[self.num_streamed_chars : end]
        self.num_streamed_chars = max(self.num_streamed_chars, end)
        return delta

    def copy(self) -> SequenceText:
        twin = copy.copy(self)
        twin.decoder = self.decoder.copy()
        return twin
