"""The decode rows kept from step to step (a persistent batch): a sequence keeps its row while it decodes, and its
row of the block tables and slots is written again only where its blocks change (a new block: one entry)."""

from __future__ import annotations

from itertools import compress, filterfalse
from operator import add, attrgetter, ne

import torch

from minigpt.engine.sequence import Sequence


class DecodeRows:
    """Block tables [rows, max_blocks] int32 on the device, and the slot of each of their positions [rows,
    max_blocks * block_size] int64; row i is `seqs[i]`'s."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.in_block = torch.arange(block_size, device=device)
        self._allocate(max_rows, max_blocks, device)
        self.seqs: list[Sequence] = []
        self.row_of: dict[Sequence, int] = {}
        self.written: list[list[int] | None] = []  # each row's table as written there; None: to write

    def _allocate(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.slots = torch.zeros(max_rows, max_blocks * len(self.in_block), dtype=torch.int64, device=device)
        # flat views: index_select and index_copy_ on them are the cheapest ops that read and write entries
        self._table_entries, self._slot_entries = self.tables.view(-1), self.slots.view(-1, len(self.in_block))

    def arrange(self, decodes: list[Sequence]) -> tuple[list[Sequence], list[int], list[int]]:
        """`decodes` in row order (a sequence that left gives its row to the last row's), and the changed table
        entries (flat indices: a grown table's new blocks, else its whole row) with their blocks, for `write`."""
        seqs, written = self.seqs, self.written
        if seqs != decodes:  # a loop in C; equal: the same rows, in their order, as the last step
            self._rearrange(decodes)
        stale = list(compress(range(len(seqs)), map(ne, written, map(attrgetter("block_table"), seqs))))
        width = self.tables.shape[1]
        entries: list[int] = []
        values: list[int] = []
        for row in stale:
            old, table = written[row], seqs[row].block_table
            start = len(old) if old is not None and table[: len(old)] == old else 0
            new = table[start:] if start else table + [0] * (width - len(table))
            entries += range(row * width + start, row * width + start + len(new))
            values += new
            written[row] = list(table)
        return list(seqs), entries, values

    def _rearrange(self, decodes: list[Sequence]) -> None:
        """A row that left takes the last row's sequence, a new one joins at the end: a loop over changes only."""
        wanted = set(decodes)
        seqs, written, row_of = self.seqs, self.written, self.row_of
        if len(wanted) > self.tables.shape[0]:  # beams join past max_num_seqs: rows double, rewritten
            self._allocate(2 * len(wanted), self.tables.shape[1], self.tables.device)
            written[:] = [None] * len(written)
        for row in sorted(map(row_of.pop, row_of.keys() - wanted), reverse=True):  # rows after it: kept ones
            last = seqs.pop()
            written.pop()
            if row < len(seqs):
                seqs[row], written[row], row_of[last] = last, None, row
        for seq in filterfalse(row_of.__contains__, decodes):
            row_of[seq] = len(seqs)
            seqs.append(seq)
            written.append(None)

    def write(self, entries: torch.Tensor, blocks: torch.Tensor) -> None:
        """The entries `arrange` found changed (flat indices into the tables) and their block ids, on the device."""
        self._table_entries.index_copy_(0, entries, blocks.to(torch.int32))
        self._slot_entries.index_copy_(0, entries, blocks[:, None] * len(self.in_block) + self.in_block)

    def slot_indices(self, positions: list[int]) -> list[int]:
        """Where the slots of the first len(positions) rows' positions are in `slots` seen flat."""
        width = self.slots.shape[1]
        return list(map(add, range(0, len(positions) * width, width), positions))

    def slots_at(self, indices: torch.Tensor) -> torch.Tensor:
        return self.slots.view(-1).index_select(0, indices)

    def block_tables(self, num_rows: int) -> torch.Tensor:
        """[num_rows, the widest table's blocks] of the rows `arrange` laid out."""
        return self.tables[:num_rows, : max(map(len, self.written[:num_rows]))].contiguous()

    def clear(self) -> None:
        self.seqs.clear()
        self.written.clear()
        self.row_of.clear()
