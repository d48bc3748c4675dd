"""The interface every request kind shares, the sampled request, and the outputs `LLM.generate` gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from minigpt.engine.sequence import Sequence
from minigpt.sampling import SamplingParams, TokenLogprobs

Prompt = str | list[int]


@dataclass
class CompletionOutput:

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" (| "abort" | "error" from the concurrent front)
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    """Seconds in the queue, to the first token and per output token after it; speculation's counters."""

    queue_time: float
    time_to_first_token: float
    time_per_output_token: float
    num_preemptions: int
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        return self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt; `token_ids`, `text`... are the first of its `outputs`."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


class EngineRequest(Protocol):
    """What the engine, LLM and a RequestHandle need of a request, whatever its kind (sampled, beam search)."""

    request_id: int
    prompt_token_ids: list[int]
    streams: bool  # its sequences are its completions, streamed as they grow

    @property
    def seqs(self) -> list[Sequence]: ...  # those still live

    @property
    def finished(self) -> bool: ...

    def output(self) -> Any: ...  # what LLM returns for it

    def request_output(self) -> RequestOutput: ...  # what its RequestHandle carries


@dataclass
class Request:
    """A prompt and its n sampled sequences."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    streams = True

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)

    def request_output(self) -> RequestOutput:
        return self.output()

    def output(self) -> RequestOutput:
        first = self.seqs[0]
        stats = [s.stats for s in self.seqs]
        metrics = RequestMetrics(
            *first.stats.latencies(len(first.output_token_ids)),
            num_preemptions=sum(s.num_preemptions for s in stats),
            num_spec_steps=sum(s.num_spec_steps for s in stats),
            num_draft_tokens=sum(s.num_draft_tokens for s in stats),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
        )
        outputs = [
            CompletionOutput(i, list(s.output_token_ids), s.text, s.finish_reason, s.logprobs)
            for i, s in enumerate(self.seqs)
        ]
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outputs, metrics, first.prompt_logprobs, self.finished
        )
