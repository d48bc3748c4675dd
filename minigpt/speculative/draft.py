"""A draft model beside the target, with its own runner, KV pool and block tables: k greedy drafts in k
batched forwards, its K/V of rejected drafts rolled back before the next proposal."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from minigpt.engine.config import EngineConfig
from minigpt.engine.kv_cache import BlockManager
from minigpt.engine.runner import ModelRunner
from minigpt.engine.sequence import Sequence
from minigpt.model.weights import check_complete, resolve_checkpoint
from minigpt.sampling import argmax
from minigpt.tokenizer.tokenizer import Tokenizer


class DraftSequence:
    """A target sequence's tokens and blocks in the draft pool, read by `ModelRunner.prepare`."""

    prompt_logprobs = None
    scores_only = False
    draft_token_ids: list[int] = []

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_synced = 0  # the target's length when the mirror last copied its tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """Every token the mirror copies is a prompt token to the draft (its own outputs are only proposed)."""
        return self.token_ids


class DraftModel:
    """The draft checkpoint's runner and pool (as many tokens as the target's, no prefix cache)."""

    def __init__(self, model: str, config: EngineConfig, num_tokens: int, tokenizer: Tokenizer,
                 vocab_limit: int, build_runner: Callable[[Path, EngineConfig], ModelRunner]) -> None:
        path = resolve_checkpoint(model)
        check_complete(path)
        check_same_tokenizer(Tokenizer.from_dir(path), tokenizer, model)
        draft_config = replace(config, kv_cache_tokens=num_tokens, speculative_config=None,
                               enable_prefix_caching=False, tensor_parallel_size=1)
        self.runner = build_runner(path, draft_config)
        if self.runner.model.config.vocab_size < vocab_limit:
            raise ValueError(f"the draft model {model!r} has {self.runner.model.config.vocab_size} token ids, "
                             f"fewer than the target's {vocab_limit}")
        self.vocab_limit = vocab_limit
        self.blocks = BlockManager(self.runner.pool.num_blocks, config.block_size, enable_prefix_caching=False)
        self.seqs: dict[Sequence, DraftSequence] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens after each sequence's tokens."""
        drafts: list[list[int]] = [[] for _ in seqs]
        mirrors = [self._sync(seq) for seq in seqs]
        for step in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if k > step and mirrors[i] is not None]
            chunks, decodes = [], []
            for i in active:
                mirror = mirrors[i]
                need = self.blocks.blocks_needed(len(mirror.token_ids)) - len(mirror.block_table)
                if not self.blocks.can_allocate(need):
                    self.release(seqs[i])  # blocks short: this sequence drafts no further this step
                    mirrors[i] = None
                    continue
                self.blocks.grow(mirror.block_table, len(mirror.token_ids))
                chunk = mirror.num_uncomputed_tokens
                if chunk == 1 and mirror.num_computed_tokens:
                    decodes.append(mirror)
                else:
                    chunks.append((mirror, chunk))
            if not chunks and not decodes:
                break
            inputs = self.runner.prepare(chunks, decodes)
            tokens = argmax(self.runner.run(inputs)[:, : self.vocab_limit].float()).tolist()
            # rows come in the runner's order (catching-up chunks, then decodes in their rows' order)
            token_of = {id(mirror): token for mirror, token in zip(inputs.sample_seqs, tokens, strict=True)}
            for mirror, chunk in [*chunks, *((mirror, 1) for mirror in decodes)]:
                mirror.num_computed_tokens += chunk
                mirror.token_ids.append(token_of[id(mirror)])
            for i in active:
                if mirrors[i] is not None:
                    drafts[i].append(mirrors[i].token_ids[-1])
        return drafts

    def _sync(self, seq: Sequence) -> DraftSequence:
        """The mirror of seq, its computed K/V cut back to the tokens the target kept."""
        mirror = self.seqs.get(seq)
        if mirror is None:
            mirror = self.seqs[seq] = DraftSequence()
        agreed = mirror.num_synced  # the tokens before it are the target's and cannot have changed
        limit = min(len(seq.token_ids), mirror.num_computed_tokens)
        while agreed < limit and mirror.token_ids[agreed] == seq.token_ids[agreed]:
            agreed += 1
        mirror.num_computed_tokens = min(agreed, mirror.num_computed_tokens)
        mirror.token_ids = list(seq.token_ids)
        mirror.num_synced = len(seq.token_ids)
        return mirror

    def release(self, seq: Sequence) -> None:
        """Return the draft blocks of a finished (or starved) sequence."""
        mirror = self.seqs.pop(seq, None)
        if mirror is not None:
            self.blocks.free_blocks(mirror.block_table)

    def close(self) -> None:
        self.runner.close()


def check_same_tokenizer(draft: Tokenizer, target: Tokenizer, name: str) -> None:
    """A draft must map text to the same ids as the target; raises ValueError if it does not."""
    if draft is target:
        return
    same = (draft.n_vocab == target.n_vocab and draft.eos_token_id == target.eos_token_id
            and draft.bos_token_id == target.bos_token_id
            and all(draft.decode_bytes([i]) == target.decode_bytes([i]) for i in range(draft.n_vocab)))
    if not same:
        raise ValueError(f"the draft model {name!r} has a different tokenizer from the target's "
                         f"({draft.n_vocab} vs {target.n_vocab} ids, or different tokens): a draft must share "
                         "the target's tokenizer")
