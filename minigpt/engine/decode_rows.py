"""The decode rows kept from step to step (a persistent batch): a decoding sequence keeps its row while it decodes,
and its row of the block tables is written again only when its blocks change, so a steady step writes none."""

from __future__ import annotations

from itertools import compress
from operator import attrgetter, ne

import torch

from minigpt.engine.sequence import Sequence


class DecodeRows:
    """Block tables [rows, max_blocks] int32 on the device; row i is `seqs[i]`'s."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.seqs: list[Sequence] = []
        self.written: list[list[int] | None] = []  # each row's table as written there; None: to write

    def arrange(self, decodes: list[Sequence]) -> tuple[list[Sequence], list[int], list[int]]:
        """`decodes` in row order (a sequence that left gives its row to the last row's), the rows whose tables
        changed, and those tables padded to the width, flat: the caller sends them with its step's copy to `write`."""
        wanted = set(decodes)
        seqs, written = self.seqs, self.written
        if len(wanted) > self.tables.shape[0]:  # beams join past max_num_seqs: rows double, rewritten
            self.tables = self.tables.new_zeros(2 * len(wanted), self.tables.shape[1])
            written[:] = [None] * len(written)
        if len(seqs) != len(wanted) or not wanted.issuperset(seqs):  # else: the same rows as the last step
            row = 0
            while row < len(seqs):
                if seqs[row] in wanted:
                    row += 1
                    continue
                seqs[row], written[row] = seqs[-1], None  # the last row moves here (itself, when it is the last)
                seqs.pop()
                written.pop()
            if len(seqs) < len(wanted):
                kept = set(seqs)
                for seq in decodes:
                    if seq not in kept:
                        seqs.append(seq)
                        written.append(None)
        stale = list(compress(range(len(seqs)), map(ne, written, map(attrgetter("block_table"), seqs))))
        width = self.tables.shape[1]
        tables = []
        for row in stale:
            written[row] = list(seqs[row].block_table)
            tables += written[row] + [0] * (width - len(written[row]))
        return list(seqs), stale, tables

    def write(self, rows: torch.Tensor, tables: torch.Tensor) -> None:
        """The rows `arrange` found changed, [len(rows)] and their tables [len(rows) * width], on the device."""
        self.tables[rows] = tables.view(len(rows), -1).to(torch.int32)

    def block_tables(self, num_rows: int) -> torch.Tensor:
        """[num_rows, the widest table's blocks] of the rows `arrange` laid out."""
        return self.tables[:num_rows, : max(map(len, self.written[:num_rows]))].contiguous()

    def clear(self) -> None:
        self.seqs.clear()
        self.written.clear()
