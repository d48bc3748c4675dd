"""Verification in one sampler call: row j of a sequence with drafts d draws as if d[:j] were generated (its
seeded draw keyed by its own position); the longest run of draws equal to d is kept, plus the next draw.

That is rejection sampling with a one-hot draft distribution, so a seeded request emits what it would
without speculation (greedy: the argmax, token for token).
"""

from __future__ import annotations

from minigpt.engine.sequence import Sequence
from minigpt.sampling import SamplingParams, TokenLogprobs


class DraftRow:
    """The sampling row of a sequence after its first `num_drafts` drafted tokens."""

    def __init__(self, seq: Sequence, num_drafts: int) -> None:
        self.params: SamplingParams = seq.params
        self.seed = seq.seed
        self.prompt_token_ids = seq.prompt_token_ids
        self.output_token_ids = seq.output_token_ids + seq.draft_token_ids[:num_drafts]


def sampling_rows(seqs: list[Sequence]) -> list:
    """One row per logits row of the step: each sequence, then one per drafted token it verifies."""
    rows: list = []
    for seq in seqs:
        rows.append(seq)
        rows += (DraftRow(seq, j) for j in range(1, len(seq.draft_token_ids) + 1))
    return rows


def accept(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> int:
    """Append the target's draws while they confirm the drafts; returns how many drafts were accepted."""
    drafts = seq.draft_token_ids
    accepted = 0
    for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        seq.append(token, lp)
        matched = j < len(drafts) and token == drafts[j]
        accepted += matched
        if seq.finished or not matched:
            break
    return accepted
