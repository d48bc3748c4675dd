"""BeamSearchParams and what `LLM.beam_search` returns: per prompt, its beam_width completions, best first."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from minigpt.common.errors import ParamError
from minigpt.sampling.params import is_int, is_real

MAX_BEAM_WIDTH = 1024  # beyond it a step's candidates (2 x beam_width ** 2) take gigabytes


_bad = functools.partial(ParamError.must_be, "BeamSearchParams")


@dataclass
class BeamSearchParams:
    """Beam search as transformers' `generate(num_beams=beam_width, do_sample=False)` runs it: hypotheses rank by
    cumulative logprob / generated tokens ** length_penalty; `early_stopping` as transformers reads it."""

    beam_width: int = 4
    max_tokens: int = 64
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise _bad(name, value, "an int >= 1")
            setattr(self, name, int(value))
        if self.beam_width > MAX_BEAM_WIDTH:
            raise _bad("beam_width", self.beam_width, f"at most {MAX_BEAM_WIDTH}")
        if not is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise _bad("length_penalty", self.length_penalty, "a finite number")
        self.length_penalty = float(self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise _bad("early_stopping", self.early_stopping, 'True, False or "never"')
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "a bool")


@dataclass
class BeamSearchSequence:
    """One finished hypothesis: generated ids (a final EOS kept), their text, the sum of their logprobs,
    the length-penalised score it was ranked by, and "stop" (ended in EOS) or "length"."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """What `LLM.beam_search` returns per prompt: `sequences` holds beam_width hypotheses, best first."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
