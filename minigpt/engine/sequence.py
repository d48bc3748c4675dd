"""One completion in flight: its tokens, its blocks (`num_computed_tokens` of them in the pool) and why it
stopped. Its text (minigpt/engine/sequence_text.py) and its statistics live beside it; the text is decoded as it
is read, off the step's path, except where stop strings need it at every token."""

from __future__ import annotations

import copy
import enum
import time
from dataclasses import dataclass, field, replace

from minigpt.engine.sequence_text import SequenceText
from minigpt.sampling import SamplingParams, TokenLogprobs
from minigpt.tokenizer.tokenizer import Tokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


RUNNING, FINISHED = Status.RUNNING, Status.FINISHED  # what the step's loops compare with: Enum lookups are slow


@dataclass
class SequenceStats:
    """When it arrived, was first scheduled, got its first token and finished; preemptions; speculation's counts."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def latencies(self, num_outputs: int) -> tuple[float, float, float]:
        """Seconds in the queue, to the first token and per output token after it (of `num_outputs`)."""
        scheduled = self.first_scheduled if self.first_scheduled is not None else self.arrival
        first_token = self.first_token if self.first_token is not None else scheduled
        end = self.finished if self.finished is not None else time.perf_counter()
        per_token = (end - first_token) / (num_outputs - 1) if num_outputs > 1 else 0.0
        return scheduled - self.arrival, first_token - self.arrival, per_token


class Sequence:
    """Tokens, blocks and status of one completion; `text_state` its text, `stats` its statistics."""

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output: what the blocks hold
        self.params, self.seed = params, seed
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.last_block_hash = 0
        self.draft_token_ids: list[int] = []  # speculation: tokens drafted for this step, verified after the last
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None
        self.text_state = SequenceText(tokenizer, params.stop)
        self._scans_stops = self.text_state.stops is not None
        self.stats = SequenceStats()
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        self.max_len = min(max_model_len, len(prompt_token_ids) + params.max_tokens)
        self._eos_ids = set(eos_token_ids)
        self._plain = False  # from its first token on, when it has no stop strings or logprobs

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

    def append(self, token_id: int, logprobs: TokenLogprobs | None = None, last: bool = False) -> None:
        """`last`: a feature ends the output at this token (a grammar it completes); an EOS there is no text."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if self._plain and not last and token_id not in self._stop_ids:  # most tokens: nothing to watch
            if len(self.token_ids) >= self.max_len:
                self._finish("length")
            return
        self._took(logprobs)
        stopped = token_id in self._stop_ids or (last and token_id in self._eos_ids)
        if stopped and len(self.output_token_ids) > self.params.min_tokens:
            self.text_state.end = len(self.output_token_ids) - 1  # the stop token is not text
            self._finish("stop")
            return
        if self._scans_stops:
            find = len(self.output_token_ids) > self.params.min_tokens
            if self.text_state.cut_at_stop(self.output_token_ids, find):
                self._finish("stop", flush=False)
                return
        if last:
            self._finish("stop")
        elif len(self.token_ids) >= self.max_len:
            self._finish("length")

    def refuse(self, token_id: int, logprobs: TokenLogprobs | None, error: str) -> None:
        """A token drawn that a feature refuses (a grammar's): kept in the output, not in its text; fails."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        self._took(logprobs)
        self.text_state.end = len(self.output_token_ids) - 1
        self.fail(error)

    def _took(self, logprobs: TokenLogprobs | None) -> None:
        if self.stats.first_token is None:
            self.stats.first_token = time.perf_counter()
            self._plain = not self._scans_stops and self.logprobs is None
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)

    @property
    def text(self) -> str:
        """The output's text so far, decoded up to its last token now."""
        return self.text_state.decoded(self.output_token_ids)

    def take_text_delta(self) -> str:
        """Text not yet streamed, holding back a tail that may still become a stop string."""
        return self.text_state.take_delta(self.output_token_ids, self.status is FINISHED)

    def _finish(self, reason: str, flush: bool = True) -> None:
        """`flush`: the text ends with what the decoder still holds (half a character, replaced)."""
        self.text_state.flush_pending = flush
        self.finish_reason = reason
        self.status = Status.FINISHED
        self.stats.finished = time.perf_counter()

    def fail(self, message: str) -> None:
        self.error = message
        self._finish("error", flush=False)

    def abort(self) -> None:
        self._finish("abort", flush=False)

    def fork(self, block_table: list[int]) -> Sequence:
        """A copy that goes on on its own, `block_table` sharing its blocks by reference."""
        child = copy.copy(self)
        child.output_token_ids, child.token_ids = list(self.output_token_ids), list(self.token_ids)
        child.block_table = block_table
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.text_state = self.text_state.copy()
        child.stats = replace(self.stats)
        return child

    def preempt(self) -> None:
        """Its blocks taken back: recompute later."""
        self.num_computed_tokens = self.num_hashed_blocks = self.last_block_hash = 0
        self.draft_token_ids = []
        self.status = Status.WAITING
        self.stats.num_preemptions += 1
