"""Token bitmasks as xgrammar and llguidance fill them: int32 [rows, words], bit j of word i allows token
32 * i + j. Applied to a batch's logits in one vectorized step."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# bit j of byte b, for every byte: the bitmask read as bytes (little-endian) indexes it
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


def allowed_tokens(bitmask: Tensor, vocab: int) -> Tensor:
    """bool [rows, vocab] from int32 bitmask [rows, bitmask_words(vocab)] (on the CPU)."""
    rows = bitmask.shape[0]
    bits = _BYTE_BITS.index_select(0, bitmask.contiguous().view(torch.uint8).view(-1).int())
    return bits.view(rows, -1)[:, :vocab]


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """logits [rows, vocab] with every token its row's bitmask does not allow at -inf (out of place)."""
    allowed = allowed_tokens(bitmask.cpu(), logits.shape[1]).to(logits.device, non_blocking=True)
    return logits.masked_fill(~allowed, -math.inf)
