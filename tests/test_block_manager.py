"""The prefix cache's blocks: a block holding generated positions stands in for the same positions only where
they are generated again, when the runner attends to generated rows by another kernel than to prompt rows. The
free list reuses empty blocks first, the last freed first, then cached ones, the longest free first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minigpt.engine.kv_cache import BlockManager, FreeBlocks

BLOCK = 4


def finished(blocks: BlockManager, prompt: list[int], output: list[int]) -> SimpleNamespace:
    """A sequence whose prompt and output are computed and whose full blocks are registered."""
    seq = SimpleNamespace(block_table=[], prompt_token_ids=prompt, token_ids=prompt + output,
                          num_computed_tokens=len(prompt) + len(output), num_hashed_blocks=0, last_block_hash=0)
    blocks.allocate(seq.block_table, [], seq.num_computed_tokens)
    blocks.register_full_blocks(seq)
    return seq


@pytest.mark.parametrize("generated_apart", [False, True])
def test_generated_blocks_match_where_generated_again(generated_apart: bool) -> None:
    blocks = BlockManager(16, BLOCK, generated_apart=generated_apart)
    prompt, output = list(range(100, 106)), list(range(200, 206))  # blocks: prompt, prompt + output, output
    seq = finished(blocks, prompt, output)
    continued = prompt + output + [7]  # a later request whose prompt is the first one's prompt and output
    assert blocks.match_prefix(continued, len(prompt)) == seq.block_table  # its own recomputation
    hits = blocks.match_prefix(continued, len(continued))
    assert hits == (seq.block_table[:1] if generated_apart else seq.block_table)
    assert blocks.match_prefix(prompt[:5], 5) == seq.block_table[:1]  # prompt blocks: shared alike


def test_free_blocks_reuse_empty_ones_first_then_the_longest_cached():
    free = FreeBlocks(4)  # 0 1 2 3, empty
    taken = [free.take() for _ in range(4)]
    assert taken == [0, 1, 2, 3] and len(free) == 0
    free.put(2, cached=True)
    free.put(0, cached=False)
    free.put(3, cached=True)
    free.put(1, cached=False)
    assert len(free) == 4
    free.revive(3)  # a cached block matched again
    assert [free.take() for _ in range(3)] == [1, 0, 2] and len(free) == 0


def test_a_revived_cached_block_leaves_the_free_list():
    blocks = BlockManager(8, BLOCK)
    seq = finished(blocks, list(range(100, 109)), [])  # two full blocks and one partial
    kept = seq.block_table[:2]
    blocks.free_blocks(seq.block_table)
    assert len(blocks.free) == 8
    again = blocks.match_prefix(list(range(100, 110)), 10)
    assert again == kept
    table: list[int] = []
    blocks.allocate(table, again, 10)
    assert table[:2] == kept and len(blocks.free) == 5 and blocks.num_used == 3
    assert [blocks.free.take() for _ in range(5)] == sorted(set(range(8)) - set(table))
