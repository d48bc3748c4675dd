"""SamplingParams: how to pick the tokens of one request, each field checked and normalised once built."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from minigpt.common.errors import Named, ParamError
from minigpt.sampling.structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # most alternatives a request may ask for, per token (OpenAI's limit)
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


_bad = functools.partial(ParamError.must_be, "SamplingParams")


def penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def biased(p: SamplingParams) -> bool:
    return p.logit_bias is not None or p.allowed_token_ids is not None


@dataclass
class SamplingParams:
    """Checked when built and again on submission, where the engine takes its own copy. temperature below 1e-5
    is greedy (dividing by less overflows float32); top_k=0 is off. `logprobs` / `prompt_logprobs`: top
    alternatives per generated / prompt token (0: the token's own only); `max_tokens=0` with `prompt_logprobs`
    scores the prompt. `logit_bias` and `allowed_token_ids` act before any penalty. `structured_outputs` takes
    neither min_tokens nor allowed_token_ids, which could leave no token the grammar allows. `argmax_only`
    (set when built): greedy with nothing that changes the logits or asks for logprobs."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        scoring = self.prompt_logprobs is not None  # max_tokens=0 then scores the prompt
        self.max_tokens = self._int("max_tokens", self.max_tokens, 0 if scoring else 1)
        self.top_k = self._int("top_k", self.top_k, 0)
        self.n = self._int("n", self.n, 1)
        self.min_tokens = self._int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ParamError("SamplingParams", "min_tokens", (" must be <= ", Named("max_tokens"),
                                                              f" ({self.max_tokens}), got {self.min_tokens!r}"))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, self._int(name, value, 0, MAX_LOGPROBS))

        self.temperature = self._real("temperature", self.temperature, lambda t: t >= 0, ">= 0")
        self.top_p = self._real("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1]")
        self.min_p = self._real("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1]")
        self.repetition_penalty = self._real("repetition_penalty", self.repetition_penalty, lambda r: r > 0,
                                             "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, self._real(name, getattr(self, name), lambda x: -2 <= x <= 2, "in [-2, 2]"))

        if self.seed is not None:  # OpenAI's int64
            self.seed = self._int("seed", self.seed, -(2**63), 2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "a bool")
        self.stop = self._stop(self.stop)
        self.stop_token_ids = self._token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = self._logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._token_ids("allowed_token_ids", self.allowed_token_ids, min_len=1)
        self._check_structured_outputs()
        # the engine's copy is built anew on submission (dataclasses.replace), so this holds for it
        self.argmax_only = (self.greedy and self.logprobs is None and not self.min_tokens and not penalised(self)
                            and not biased(self))

    def _check_structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        if self.min_tokens:
            raise _bad("min_tokens", self.min_tokens, "0 with structured_outputs (EOS may end the grammar)")
        if self.allowed_token_ids is not None:
            raise _bad("allowed_token_ids", self.allowed_token_ids, "None with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @staticmethod
    def _int(field: str, value: Any, lo: int, hi: int | None = None) -> int:
        if not is_int(value) or value < lo or (hi is not None and value > hi):
            raise _bad(field, value, f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]")
        return int(value)

    @staticmethod
    def _real(field: str, value: Any, ok: Callable[[float], bool], expected: str) -> float:
        if not is_real(value) or not math.isfinite(value) or not ok(value):
            raise _bad(field, value, f"a finite number {expected}")
        return float(value)

    @staticmethod
    def _stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        stops = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop", stop, "a non-empty str or a list of non-empty str")
        return tuple(stops)

    @staticmethod
    def _token_ids(field: str, ids: Any, min_len: int = 0) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)) or len(ids) < min_len or not all(is_int(i) and i >= 0 for i in ids):
            raise _bad(field, ids, f"a {'non-empty ' if min_len else ''}list of non-negative ints")
        return tuple(int(i) for i in ids)

    @staticmethod
    def _logit_bias(bias: Any) -> dict[int, float] | None:
        # a new dict each time: the caller's may change without reaching a submitted request
        if bias is None:
            return None
        if not isinstance(bias, Mapping) or not all(
            is_int(i) and i >= 0 and is_real(b) and math.isfinite(b) for i, b in bias.items()
        ):
            raise _bad("logit_bias", bias, "a dict of non-negative int token ids to finite numbers")
        return {int(i): float(b) for i, b in bias.items()} or None
