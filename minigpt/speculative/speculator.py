"""Speculation plugged into the engine: drafts for the sequences about to decode, verified after sampling.

Each sequence drafts the k that maximizes (1 - a^(k+1)) / (1 - a) tokens, at its acceptance a, per unit of
work; when no k pays, it probes with one draft after a pause that doubles each time the probe fails.
"""

from __future__ import annotations

from collections.abc import Callable

from minigpt.engine.config import EngineConfig
from minigpt.engine.engine import Engine
from minigpt.engine.kv_cache import BlockManager
from minigpt.engine.scheduler import ScheduledBatch
from minigpt.engine.sequence import Sequence
from minigpt.engine.speculative_config import SpeculativeConfig
from minigpt.sampling import TokenLogprobs
from minigpt.speculative.ngram import ngram_draft
from minigpt.speculative.verify import accept, sampling_rows
from minigpt.tokenizer.tokenizer import Tokenizer

PRIOR_ACCEPTANCE = 0.7  # a new sequence's estimate: optimistic, so speculation is tried first
SMOOTHING = 0.3  # weight of the latest step in the acceptance estimate
VERIFY_COST_PER_TOKEN = 0.05  # a verified draft row's cost, in target decode forwards
FIRST_PAUSE, MAX_PAUSE = 4, 64  # decode steps without drafts before speculation is tried again
PROBE_MARGIN = 0.05


class _Adaptive:
    def __init__(self) -> None:
        self.acceptance = PRIOR_ACCEPTANCE
        self.pause = 0  # decode steps left without drafts
        self.next_pause = FIRST_PAUSE


class Speculator:
    """Proposes drafts (n-gram lookup or a draft model) and learns per sequence how many pay off."""

    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig, tokenizer: Tokenizer,
                 vocab_limit: int, blocks: BlockManager, num_kv_tokens: int, target_params: int,
                 build_runner: Callable) -> None:
        self.config, self.blocks = config, blocks
        self.draft_model = None
        self.draft_cost = 0.0  # one draft forward, in target forwards
        if config.method == "draft_model":
            from minigpt.speculative.draft import DraftModel

            self.draft_model = DraftModel(config.model, engine_config, num_kv_tokens, tokenizer, vocab_limit,
                                          build_runner)
            self.draft_cost = sum(p.numel() for p in self.draft_model.runner.model.parameters()) / target_params
        self._adaptive: dict[Sequence, _Adaptive] = {}
        # just above the break-even of one draft: (1 + a) tokens for 1 + draft_cost + VERIFY_COST_PER_TOKEN
        self._probe_acceptance = min(self.draft_cost + VERIFY_COST_PER_TOKEN + PROBE_MARGIN, PRIOR_ACCEPTANCE)

    def draft(self, batch: ScheduledBatch, max_num_batched_tokens: int) -> None:
        """Drafts for the step's decodes, within the token budget and the free blocks: those given some are chunks."""
        budget = max_num_batched_tokens - sum(chunk for _, chunk in batch.chunks) - len(batch.decodes)
        seqs, ks = [], []
        for seq in batch.decodes:
            if seq.params.structured_outputs is not None:
                continue  # structured outputs: the grammar takes one token a step
            k = min(self._k(seq), seq.max_len - len(seq.token_ids) - 1, budget)  # never past max_tokens
            if k > 0:
                seqs.append(seq)
                ks.append(k)
                budget -= k
        if not seqs:
            return
        if self.draft_model is not None:
            drafts = self.draft_model.propose(seqs, ks)
        else:
            c = self.config
            drafts = [ngram_draft(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
                      for seq, k in zip(seqs, ks, strict=True)]
        blocks = self.blocks
        for seq, draft in zip(seqs, drafts, strict=True):
            spare = len(seq.block_table) + len(blocks.free)
            draft = draft[: spare * blocks.block_size - len(seq.token_ids)]
            blocks.grow(seq.block_table, len(seq.token_ids) + len(draft))
            seq.draft_token_ids = draft
        batch.chunks += [(seq, 1 + len(seq.draft_token_ids)) for seq in seqs if seq.draft_token_ids]
        batch.decodes = [seq for seq in batch.decodes if not seq.draft_token_ids]

    def _k(self, seq: Sequence) -> int:
        if not self.config.adaptive:
            return self.config.num_speculative_tokens
        state = self._adaptive.setdefault(seq, _Adaptive())
        if state.pause:
            state.pause -= 1
            return 0
        k = self._best_k(state.acceptance)
        if k == 0:  # after a pause, probe: one accepted draft keeps drafting on, one rejected pauses again
            state.pause, state.next_pause = state.next_pause, min(2 * state.next_pause, MAX_PAUSE)
            state.acceptance = self._probe_acceptance
        return k

    def _best_k(self, a: float) -> int:
        best, best_gain = 0, 1.0
        for k in range(1, self.config.num_speculative_tokens + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1
            gain = tokens / (1 + k * (self.draft_cost + VERIFY_COST_PER_TOKEN))
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    sampling_rows = staticmethod(sampling_rows)

    def verify(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> None:
        """Keep the draws that confirm seq's drafts; roll the rejected drafts' K/V back, return spare blocks."""
        num_drafts = len(seq.draft_token_ids)
        self.record(seq, num_drafts, accept(seq, tokens, logprobs))
        seq.draft_token_ids = []
        if seq.finished:
            return
        seq.num_computed_tokens = len(seq.token_ids) - 1  # the last token's K/V is computed next step
        self.blocks.register_full_blocks(seq)
        self.blocks.shrink(seq.block_table, len(seq.token_ids))

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        stats = seq.stats
        stats.num_spec_steps += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        state = self._adaptive.get(seq)
        if state is not None:
            trials = num_accepted + (num_accepted < num_drafts)  # drafts after the first rejection are not tried
            state.acceptance += SMOOTHING * (num_accepted / trials - state.acceptance)
            if num_accepted:
                state.next_pause = FIRST_PAUSE

    def release(self, seq: Sequence) -> None:
        self._adaptive.pop(seq, None)
        if self.draft_model is not None:
            self.draft_model.release(seq)

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()


def plug_speculation(engine: Engine, build_runner: Callable) -> None:
    """The speculator engine.config.speculative_config asks for (a draft model's runner built by `build_runner`,
    as the target's is)."""
    runner = engine.runner
    engine.speculator = Speculator(
        SpeculativeConfig.parse(engine.config.speculative_config), engine.config, engine.tokenizer,
        engine.vocab_limit, engine.blocks, runner.pool.num_tokens, sum(p.numel() for p in runner.model.parameters()),
        build_runner,
    )
