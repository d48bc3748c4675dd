"""What features plug into the step through: postprocessors over a step's logits, and speculation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minigpt.common.transfer import HostCopy
from minigpt.engine.runner import StepInputs, num_sample_rows
from minigpt.engine.scheduler import ScheduledBatch
from minigpt.engine.sequence import Sequence
from minigpt.sampling import TokenLogprobs


@dataclass
class Step:
    """One step's logits on their way to tokens: a postprocessor takes its sequences' rows out."""

    batch: ScheduledBatch
    inputs: StepInputs
    logits: torch.Tensor
    seqs: list[Sequence]  # the sequences still to sample, in row order
    rows: list[int]  # their logits rows: one each, plus one per draft it verifies
    updated: list[Sequence] = field(default_factory=list)  # what Engine.step returns
    num_tokens: int = 0  # the tokens its sequences gained, once sampled
    drawn: HostCopy | None = None  # its tokens drawn already (an overlapped step's), one per row, read late

    def spans(self) -> Iterator[tuple[Sequence, slice]]:
        """Each sequence still to sample with its slice of `rows`."""
        row = 0
        for seq in self.seqs:
            n = num_sample_rows(seq)
            yield seq, slice(row, row + n)
            row += n

    def take(self, claim: Callable[[Sequence], object]) -> tuple[list[Sequence], list[int]]:
        """Take out the sequences `claim` picks (a truthy answer); returns them and their rows."""
        taken: tuple[list[Sequence], list[int]] = ([], [])
        kept: tuple[list[Sequence], list[int]] = ([], [])
        for seq, rows in self.spans():
            seqs, picked = taken if claim(seq) else kept
            seqs.append(seq)
            picked += self.rows[rows]
        self.seqs, self.rows = kept
        return taken


class Postprocessor(Protocol):
    """A feature's part of every step, run before sampling: takes its sequences' rows out and gives them tokens."""

    def __call__(self, step: Step) -> None: ...

    def acts_on(self, step: Step) -> bool: ...  # False: the call would leave this step as it is


class Speculation(Protocol):
    """Drafts added before the runner lays a step out, verified once the sampler has drawn every row."""

    def draft(self, batch: ScheduledBatch, max_num_batched_tokens: int) -> None: ...  # decodes given drafts: chunks

    def sampling_rows(self, seqs: list[Sequence]) -> list: ...  # one per logits row

    def verify(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> None: ...

    def release(self, seq: Sequence) -> None: ...  # seq finished

    def close(self) -> None: ...
