"""Verification: which drafted tokens the target keeps, in one sampler call over every verified row.

Row j of a sequence with drafts d is the target's distribution after d[:j]; the sampler draws each row's
token as if d[:j] had been generated (penalties and min_tokens over them, the seeded draw keyed by the
row's own position). The sequence keeps the longest run of rows whose draw equals the draft, plus the
first draw that differs (or the bonus row after the last draft).

That is rejection sampling with a one-hot draft distribution q (both proposers draft deterministically):
d[j] is kept with probability p(d[j]) = min(1, p/q), and a rejected row's draw is p conditioned on not
d[j], which is the normalized residual max(0, p - q). Each emitted token is the draw the same seed gives
at that position without speculation, so seeded requests stay reproducible, batch-independent, and
equal to the same request run without speculation (greedy: the argmax, token for token).
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
        self.grammar = None  # a sequence with structured outputs drafts nothing (Speculator.draft)


def sampling_rows(seqs: list[Sequence]) -> list:
    """One row per logits row of the step: each sequence, then one per drafted token it verifies."""
    rows: list = []
    for seq in seqs:
        rows.append(seq)
        rows += (DraftRow(seq, j) for j in range(1, len(seq.draft_token_ids) + 1))
    return rows


def accept(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> int:
    """Append the target's draws while they confirm the drafts (one row per draft, plus one); returns how many
    drafts were accepted. Stops at a stop token, a stop string or max_tokens like any append."""
    drafts = seq.draft_token_ids
    accepted = 0
    for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        seq.append(token, lp)
        matched = j < len(drafts) and token == drafts[j]
        accepted += matched
        if seq.finished or not matched:
            break
    return accepted
