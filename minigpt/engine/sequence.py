"""One completion in flight: its tokens, its pages (`num_computed_tokens` of them in the pool), its text
so far (ending before the first stop string, as OpenAI's does) and why it stopped. The text is decoded as it is
read, off the step's path, except where stop strings need it at every token."""

from __future__ import annotations

import copy
import enum
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from minigpt.engine.stop_strings import stop_strings
from minigpt.sampling import SamplingParams, TokenLogprobs
from minigpt.tokenizer.tokenizer import IncrementalDecoder, Tokenizer


class Grammar(Protocol):
    """A structured output's state, advanced by every token appended."""

    complete: bool  # satisfied, allowing nothing more but EOS
    error: str

    def advance(self, token_id: int) -> bool: ...  # False: the grammar refuses the token


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


RUNNING, FINISHED = Status.RUNNING, Status.FINISHED  # what the step's loops compare with: Enum lookups are slow


@dataclass
class Timings:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Sequence:
    """Tokens, pages and text of one completion."""

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        grammar: Grammar | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output: what the pages hold
        self.params, self.seed = params, seed
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.timings = Timings()
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.last_block_hash = 0
        self.num_preemptions = 0
        # speculation: tokens drafted for this step (verified after the last token), and counters
        self.draft_token_ids: list[int] = []
        self.num_spec_steps = self.num_draft_tokens = self.num_accepted_tokens = 0
        self._text = ""
        self._num_decoded = 0  # output tokens in _text
        self._text_end: int | None = None  # output tokens the text covers, where a last one is not its (None: all)
        self._flush_pending = False  # finished with the decoder's tail still to add to the text
        self.num_streamed_chars = 0
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        self._decoder = IncrementalDecoder(tokenizer)
        self._stops = stop_strings(params.stop) if params.stop else None
        self._stop_state = 0  # where the text so far leaves the stop strings' automaton
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        self.max_len = min(max_model_len, len(prompt_token_ids) + params.max_tokens)
        self.grammar = grammar
        self._eos_ids = set(eos_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is FINISHED

    @property
    def scores_only(self) -> bool:
        """max_tokens=0: the prompt's logprobs are the whole answer; nothing is sampled."""
        return self.params.max_tokens == 0

    def finish_scoring(self) -> None:
        self._finish("length", flush=False)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids) - self.num_computed_tokens

    def append(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        if self.timings.first_token is None:
            self.timings.first_token = time.perf_counter()
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        grammar_done = False
        if self.grammar is not None:
            if not self.grammar.advance(token_id):
                self._text_end = len(self.output_token_ids) - 1
                self.fail(f"token {token_id} does not fit the structured output's grammar: {self.grammar.error}")
                return
            grammar_done = self.grammar.complete
        stopped = token_id in self._stop_ids or (grammar_done and token_id in self._eos_ids)
        if stopped and len(self.output_token_ids) > self.params.min_tokens:
            self._text_end = len(self.output_token_ids) - 1  # the stop token is not text
            self._finish("stop")
            return
        if self._stops is not None:
            self._scan_stop_strings()
            if self.finished:
                return
        if grammar_done:
            self._finish("stop")
        elif len(self.token_ids) >= self.max_len:
            self._finish("length")

    @property
    def text(self) -> str:
        """The output's text so far, decoded up to its last token now."""
        ids = self.output_token_ids
        end = len(ids) if self._text_end is None else self._text_end
        if self._num_decoded < end:
            self._text += self._decoder.feed_all(ids[self._num_decoded : end])
            self._num_decoded = end
        if self._flush_pending:
            self._text += self._decoder.flush()
            self._flush_pending = False
        return self._text

    def _scan_stop_strings(self) -> None:
        start = len(self._text)
        delta = self.text[start:]
        find = len(self.output_token_ids) > self.params.min_tokens
        self._stop_state, index = self._stops.scan(self._stop_state, delta, find)
        if index is not None:
            self._text = self._text[: start + index]
            self._finish("stop", flush=False)

    def _finish(self, reason: str, flush: bool = True) -> None:
        """`flush`: the text ends with what the decoder still holds (half a character, replaced)."""
        self._flush_pending = flush
        self.finish_reason = reason
        self.status = Status.FINISHED
        self.timings.finished = time.perf_counter()

    def fail(self, message: str) -> None:
        self.error = message
        self._finish("error", flush=False)

    def abort(self) -> None:
        self._finish("abort", flush=False)

    def take_text_delta(self) -> str:
        """Text not yet streamed, holding back a tail that may still become a stop string."""
        end = len(self.text)  # decodes what is new
        if not self.finished and self._stops is not None:
            end -= self._stops.held[self._stop_state]
        delta = self.text[self.num_streamed_chars : end]
        self.num_streamed_chars = max(self.num_streamed_chars, end)
        return delta

    def fork(self, block_table: list[int]) -> Sequence:
        """A copy that goes on on its own, `block_table` sharing its pages by reference."""
        child = copy.copy(self)
        child.output_token_ids, child.token_ids = list(self.output_token_ids), list(self.token_ids)
        child.block_table = block_table
        child.timings = replace(self.timings)
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child._decoder = self._decoder.copy()
        return child

    def preempt(self) -> None:
        """Its pages taken back: recompute later."""
        self.num_computed_tokens = self.num_hashed_blocks = self.last_block_hash = 0
        self.draft_token_ids = []
        self.status = Status.WAITING
        self.num_preemptions += 1

