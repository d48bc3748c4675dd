"""The paged KV pool, allocated once, and the block manager: free list, reference counts, a prefix cache of
full blocks by chained hash, and copy-on-write for blocks that forked tables share."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

import torch

from minigpt.model.config import GPT2Config


class CachedSequence(Protocol):
    block_table: list[int]
    prompt_token_ids: list[int]
    token_ids: list[int]
    num_computed_tokens: int
    num_hashed_blocks: int
    last_block_hash: int


def bytes_per_token(config: GPT2Config, dtype: torch.dtype) -> int:
    return 2 * config.n_layer * config.n_embd * torch.empty((), dtype=dtype).element_size()


class KVPool:
    def __init__(
        self, config: GPT2Config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
        spare_blocks: int = 0,
    ) -> None:
        """`spare_blocks` are given to no sequence (a CUDA graph's padding rows write into one)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (config.n_layer, 2, num_blocks + spare_blocks, block_size, config.n_head, config.head_dim)
        # zeroed: attention reads whole blocks under a mask, and NaN * 0 = NaN
        try:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            size = self.num_tokens * bytes_per_token(config, dtype)
            raise MemoryError(
                f"the KV pool of {self.num_tokens:,} tokens ({size / 2**30:,.1f} GiB of {dtype} on {device}) "
                "could not be allocated: lower kv_cache_tokens or kv_cache_memory"
            ) from err

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class FreeBlocks:
    """The free blocks in the order they are reused: those holding nothing the prefix cache can match first
    (the last freed first), then those it can (the longest free first). A cached one leaves in O(1) when its
    prefix is matched again."""

    def __init__(self, num_blocks: int) -> None:
        self._empty: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._empty) + len(self._cached)

    def take(self) -> int:
        return self._empty.popleft() if self._empty else self._cached.popitem(last=False)[0]

    def put(self, block: int, cached: bool) -> None:
        if cached:
            self._cached[block] = None
        else:
            self._empty.appendleft(block)

    def revive(self, block: int) -> None:
        """Take out a cached block whose tokens are wanted again."""
        del self._cached[block]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 generated_apart: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        # a block holding generated positions matches only where they are generated again (a preempted sequence's
        # recomputation): for runners whose prompt rows attend by another kernel than generated ones
        self.generated_apart = generated_apart
        self.free = FreeBlocks(num_blocks)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # chained hash of a full block -> block id
        self.num_hit_blocks = 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block = self.free.take()
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        old = self.block_hash[block]
        if old is not None and self.cached.get(old) == block:
            del self.cached[old]
        self.block_hash[block] = self.block_tokens[block] = None

    def _share(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.free.revive(block)  # a freed block that still holds its tokens
        self.ref_counts[block] += 1

    def match_prefix(self, token_ids: Sequence[int], prompt_length: int) -> list[int]:
        """The cached blocks of the longest run of full blocks of `token_ids` (the first `prompt_length` of them
        a prompt), never its last token's."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], 0
        for index in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = self._chain(parent, tokens, index, prompt_length)
            block = self.cached.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
        return hits

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= len(self.free)

    def allocate(self, block_table: list[int], cached_blocks: list[int], num_tokens: int) -> None:
        for block in cached_blocks:
            self._share(block)
        self.num_hit_blocks += len(cached_blocks)
        block_table.extend(cached_blocks)
        self.grow(block_table, num_tokens)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need > len(self.free):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self.free)} free")
        block_table.extend(self._take() for _ in range(need))

    def add_blocks(self, block_tables: list[list[int]]) -> None:  # one each: `can_allocate` said there are enough
        for block_table in block_tables:
            block_table.append(self._take())

    def fork(self, block_table: list[int]) -> list[int]:
        for block in block_table:
            self.ref_counts[block] += 1
        return list(block_table)

    def has_room(self, block_table: list[int], position: int, num_tokens: int) -> bool:
        """True when the table's own blocks already hold positions `position`..`num_tokens` - 1."""
        if num_tokens > len(block_table) * self.block_size:
            return False
        return self.ref_counts[block_table[position // self.block_size]] <= 1  # not shared (position < num_tokens)

    def shares(self, block_table: list[int], position: int) -> bool:
        index = position // self.block_size
        return index < len(block_table) and self.ref_counts[block_table[index]] > 1

    def copy_on_write(self, block_table: list[int], position: int) -> tuple[int, int] | None:
        """(shared, fresh) when the block at `position` was shared and is now this table's own copy to fill."""
        if not self.shares(block_table, position):
            return None
        index = position // self.block_size
        shared, fresh = block_table[index], self._take()
        self.ref_counts[shared] -= 1
        block_table[index] = fresh
        return shared, fresh

    def shrink(self, block_table: list[int], num_tokens: int) -> None:
        self.free_blocks(block_table[self.blocks_needed(num_tokens) :])
        del block_table[self.blocks_needed(num_tokens) :]

    def register_full_blocks(self, seq: CachedSequence) -> None:
        if not self.enable_prefix_caching:
            return
        while seq.num_hashed_blocks < seq.num_computed_tokens // self.block_size:
            index = seq.num_hashed_blocks
            block = seq.block_table[index]
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            seq.last_block_hash = self._chain(seq.last_block_hash, tokens, index, len(seq.prompt_token_ids))
            if self.block_hash[block] is None:
                self.block_hash[block], self.block_tokens[block] = seq.last_block_hash, tokens
                self.cached.setdefault(seq.last_block_hash, block)
            seq.num_hashed_blocks += 1

    def _chain(self, parent: int, tokens: tuple[int, ...], index: int, prompt_length: int) -> int:
        """The chained hash of block `index` holding `tokens` after the blocks hashed to `parent`."""
        if self.generated_apart and (index + 1) * self.block_size > prompt_length:
            return hash((parent, tokens, "generated"))
        return hash((parent, tokens))

    def free_blocks(self, block_table: list[int]) -> None:
        """Freed blocks keep their tokens for the prefix cache until reused."""
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free.put(block, cached=self.block_hash[block] is not None)
        block_table.clear()
