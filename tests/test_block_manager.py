"""The prefix cache's blocks: a block holding generated positions stands in for the same positions only where
they are generated again, when the runner attends to generated rows by another kernel than to prompt rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minigpt.engine.kv_cache import BlockManager

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
