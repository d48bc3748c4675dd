"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every sequence has tokens whose K/V are not in the pool yet (a prompt, a chunk of one, a recomputation
after preemption, the token sampled last step): running ones go first, then waiting ones are admitted.
When blocks run out the newest running sequence is preempted and waits to be recomputed. A step after one in which
every running sequence took one token decodes them all again with no Python loop over them (`_decode_all`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import add, attrgetter, gt, mul

from minigpt.engine.kv_cache import BlockManager
from minigpt.engine.sequence import RUNNING, Sequence, Status

_block_table, _token_ids, _draft_token_ids = map(attrgetter, ("block_table", "token_ids", "draft_token_ids"))


@dataclass
class ScheduledBatch:
    """One step: `decodes` compute their last token after a computed context, `chunks` (sequence, tokens) the
    rest (prompts, their chunks, drafts to verify); the (source, destination) blocks to copy."""

    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.chunks) + len(self.decodes)

    @property
    def seqs(self) -> list[Sequence]:
        return [seq for seq, _ in self.chunks] + self.decodes


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._whole: ScheduledBatch | None = None  # the last batch that holds every running sequence, none preempted
        self._steady = False  # `_whole` was postprocessed with one token each: the next step decodes them all again
        self._forked: set[Sequence] = set()  # beams not finished, whose tables may share a block being filled

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def took_one_token_each(self, batch: ScheduledBatch) -> None:
        """`batch` is postprocessed, each of its sequences one token longer (or finished), nothing else changed."""
        self._steady = batch is self._whole

    def schedule(self) -> ScheduledBatch:
        steady, self._steady = self._steady, False
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if steady and len(self.running) <= budget and self._decode_all(batch):
            budget -= len(batch.decodes)
        else:
            budget = self._schedule_running(batch, budget)
        if not batch.preempted:
            self._admit(batch, budget)
        if not batch.num_seqs and self.waiting:  # waiting beams' siblings hold the blocks they need
            idle = [seq for seq in self.running if not seq.num_uncomputed_tokens]
            while not batch.num_seqs and self.waiting and idle:
                self._preempt(idle.pop(), batch, front=False)
                self._admit(batch, budget)
        if not batch.preempted and batch.num_seqs == len(self.running):
            self._whole = batch
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        has_room = self.blocks.has_room
        chunks, decodes = batch.chunks, batch.decodes
        for seq in list(self.running):
            if seq.status is not RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or no budget left
            first = seq.num_computed_tokens
            uncomputed = len(seq.token_ids) + len(seq.draft_token_ids) - first
            if not uncomputed:
                continue  # a beam waiting for its siblings
            chunk = uncomputed if uncomputed <= budget else budget
            if not has_room(seq.block_table, first, first + chunk) and not self._make_room(seq, first + chunk, batch):
                continue  # seq preempted itself
            # a decode: a sequence with an output, or a prompt's last token that is drawn from (not `scores_only`)
            if uncomputed == 1 and first and (seq.output_token_ids or not seq.scores_only):
                decodes.append(seq)
            else:
                chunks.append((seq, chunk))
            budget -= chunk
        return budget

    def _decode_all(self, batch: ScheduledBatch) -> bool:
        """Every running sequence decodes, one token past the whole batch before; False: blocks short, or beams."""
        if self._forked or not self._grow_for_next(0):
            return False
        batch.decodes = list(self.running)
        return True

    def schedule_ahead(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        """The step `schedule` will give once `seqs`' tokens (being drawn) are appended, given now: when they are all
        that runs, none waits or drafts, no beam's table is forked, and blocks are free. None: read the tokens first."""
        running = self.running
        if (self.waiting or self._forked or len(seqs) != len(running) or len(seqs) > self.max_num_batched_tokens
                or any(map(_draft_token_ids, running)) or not self._grow_for_next(1)):
            return None
        self._whole = ScheduledBatch(decodes=list(running))
        return self._whole

    def _grow_for_next(self, ahead: int) -> bool:
        """A block more (one at most: earlier positions have slots) for each running table lacking its sequence's
        next position, its last token `ahead` tokens on, in C loops; False, nothing changed, when too few are free."""
        running, blocks = self.running, self.blocks
        tables = list(map(_block_table, running))
        capacities = map(mul, map(len, tables), repeat(blocks.block_size))
        lengths = map(len, map(_token_ids, running))
        growing = list(compress(tables, map(gt, map(add, lengths, repeat(ahead)) if ahead else lengths, capacities)))
        if not blocks.can_allocate(len(growing)):
            return False
        blocks.add_blocks(growing)
        return True

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give seq blocks of its own up to `num_tokens` (it had not `has_room`), preempting newer sequences while
        blocks are short."""
        first = seq.num_computed_tokens
        while not self.blocks.can_allocate(
            self.blocks.blocks_needed(num_tokens) - len(seq.block_table) + self.blocks.shares(seq.block_table, first)
        ):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        copy = self.blocks.copy_on_write(seq.block_table, first)
        if copy is not None:
            batch.copies.append(copy)
        self.blocks.grow(seq.block_table, num_tokens)
        return True

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        admitted_requests: set[int] = set()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            use_cache = seq.params.prompt_logprobs is None  # scoring needs every prompt position computed
            if seq.request_id in admitted_requests and use_cache and self._shareable(seq):
                break  # a sibling completion (n > 1) waits one step, then reuses the prompt's blocks
            cached = self.blocks.match_prefix(seq.token_ids, len(seq.prompt_token_ids)) if use_cache else []
            num_cached = len(cached) * self.blocks.block_size
            chunk = min(len(seq.token_ids) - num_cached, budget)
            revived = sum(1 for block in cached if self.blocks.ref_counts[block] == 0)
            fresh = self.blocks.blocks_needed(num_cached + chunk) - len(cached)
            if not self.blocks.can_allocate(fresh + revived):
                break
            self.waiting.popleft()
            if seq.stats.first_scheduled is None:  # not when readmitted after a preemption
                seq.stats.first_scheduled = time.perf_counter()
            self.blocks.allocate(seq.block_table, cached, num_cached + chunk)
            seq.num_computed_tokens = num_cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            if num_cached and len(seq.token_ids) - num_cached == 1:  # its last token after its cached blocks
                batch.decodes.append(seq)
            else:
                batch.chunks.append((seq, chunk))
            budget -= chunk
            admitted_requests.add(seq.request_id)

    def _shareable(self, seq: Sequence) -> bool:
        """Whether seq's prompt has a full block another sequence could share from the prefix cache."""
        return self.blocks.enable_prefix_caching and len(seq.token_ids) - 1 >= self.blocks.block_size

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, front: bool = True) -> None:
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table)
        seq.preempt()
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)
        batch.preempted.append(seq)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """A fork of `parent` joins it: running, or waiting right behind it."""
        self._forked.update((parent, child))
        if parent.status is Status.RUNNING:
            self.running.append(child)
        else:
            self.waiting.insert(self.waiting.index(parent) + 1, child)

    def finish(self, seq: Sequence) -> None:
        self._forked.discard(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_blocks(seq.block_table)
