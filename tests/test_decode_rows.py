"""The decode rows' block tables and slots on the device follow each sequence's table through growth, an entry
replaced (a copy on write), rows leaving and joining, and the rows doubling past their number."""

import random

import torch

from minigpt.engine.decode_rows import DecodeRows

BS = 4  # tokens a block


class Row:
    def __init__(self, blocks: list[int]) -> None:
        self.block_table = blocks


def check(rows: DecodeRows, decodes: list[Row]) -> list[Row]:
    order, entries, blocks = rows.arrange(decodes)
    assert sorted(map(id, order)) == sorted(map(id, decodes))
    assert all(rows.row_of[seq] == row for row, seq in enumerate(order)) and len(rows.row_of) == len(order)
    if entries:
        rows.write(torch.tensor(entries), torch.tensor(blocks))
    width = rows.tables.shape[1]
    want = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in order]
    assert rows.tables[: len(order)].tolist() == want
    positions = [BS * len(seq.block_table) - 1 - i % BS for i, seq in enumerate(order)]  # in each one's last block
    got = rows.slots_at(torch.tensor(rows.slot_indices(positions))).tolist()
    assert got == [seq.block_table[p // BS] * BS + p % BS for seq, p in zip(order, positions, strict=True)]
    assert rows.block_tables(len(order)).shape[1] == max(len(seq.block_table) for seq in order)
    return order


def test_tables_follow_the_sequences():
    rng = random.Random(0)
    rows = DecodeRows(4, 8, BS, torch.device("cpu"))
    live = [Row([rng.randrange(100) for _ in range(rng.randrange(1, 4))]) for _ in range(3)]
    for step in range(300):
        for seq in live:
            if rng.random() < 0.3 and len(seq.block_table) < 8:
                seq.block_table.append(rng.randrange(100))  # a new block
            if rng.random() < 0.05:
                seq.block_table[-1] = rng.randrange(100)  # its last block copied on write
        for _ in range(rng.choice([0, 0, 1, 2])):  # several leaving at once: the last rows among them
            if len(live) > 1:
                live.remove(rng.choice(live))
        if rng.random() < 0.2:
            live.append(Row([rng.randrange(100) for _ in range(rng.randrange(1, 8))]))
        order = check(rows, live)
        if step % 7:
            live = order  # now and then the rows' own order, where the list comparison finds them unchanged
    assert rows.tables.shape[0] >= len(live)


def test_a_steady_step_writes_nothing():
    rows = DecodeRows(4, 8, BS, torch.device("cpu"))
    seqs = [Row([1, 2]), Row([3])]
    check(rows, seqs)
    assert rows.arrange(seqs)[1:] == ([], [])
    seqs[1].block_table.append(9)
    order, entries, blocks = rows.arrange(seqs)
    assert blocks == [9] and len(entries) == 1  # only the new block's entry
