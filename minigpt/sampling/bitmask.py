"""Token bitmasks as llguidance fills them: int32 [rows, words], bit j of word i allows token 32 * i + j."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# bit j of byte b, for every byte: the bitmask read as bytes (little-endian) indexes it
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]
# the same as what to add to a logit: 0 or -inf
_BYTE_PENALTY = torch.zeros(256, 8).masked_fill_(~_BYTE_BITS, -math.inf)


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


def bitmask_of(token_ids: list[int], words: int) -> Tensor:
    """int32 [words] with the bits of `token_ids` set."""
    bits = torch.zeros(words * 32, dtype=torch.uint8)
    bits[token_ids] = 1
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words_u32 = (bits.view(words, 32).to(torch.int64) * weights).sum(dim=1)
    return torch.where(words_u32 >= 1 << 31, words_u32 - (1 << 32), words_u32).to(torch.int32)


def _unpacked(table: Tensor, bitmask: Tensor, vocab: int) -> Tensor:
    """table's row of each byte of bitmask [rows, words], as [rows, vocab]."""
    values = table.index_select(0, bitmask.contiguous().view(torch.uint8).view(-1).int())
    return values.view(bitmask.shape[0], -1)[:, :vocab]


def allowed_tokens(bitmask: Tensor, vocab: int) -> Tensor:
    """bool [rows, vocab] from int32 bitmask [rows, bitmask_words(vocab)] (on the CPU)."""
    return _unpacked(_BYTE_BITS, bitmask, vocab)


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """fp32 logits [rows, vocab] with every token its row's bitmask does not allow at -inf (out of place)."""
    penalty = _unpacked(_BYTE_PENALTY, bitmask.cpu(), logits.shape[1])
    return logits + penalty.to(logits.device, non_blocking=True)
