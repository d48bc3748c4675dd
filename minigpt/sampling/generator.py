"""Gumbel noise from a counter-based hash of (seed, step, stream, id): a row's draw depends only on its
logits, seed and step, never on its batch or a recomputation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from minigpt.common.transfer import to_device

# tensor values stay below 2**32 in int64 and every product below 2**63: no signed overflow
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_keys(seeds: Sequence[int], steps: Sequence[int], stream: int = 0) -> list[int]:
    return [_splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ step) ^ stream)
            for seed, step in zip(seeds, steps, strict=True)]


def _mul32(x: Tensor, c: int) -> Tensor:
    """x * c mod 2**32 for x < 2**32, split in 16-bit halves of c so no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(keys: Sequence[int], ids: Tensor) -> Tensor:
    """fp64 Gumbel noise per (row key, id) for int64 ids [rows, m]; u = (hash + 1/2) / 2**32 is inside (0, 1)."""
    lo = to_device([k & _MASK32 for k in keys], torch.int64, ids.device)[:, None]
    hi = to_device([k >> 32 for k in keys], torch.int64, ids.device)[:, None]
    h = _fmix32((_fmix32(ids ^ lo) + hi) & _MASK32)  # two rounds: every key bit reaches every output bit
    u = (h.to(torch.float64) + 0.5) * 2.0**-32
    return -torch.log(-torch.log(u))


def gumbel_argmax(x: Tensor, seeds: Sequence[int], steps: Sequence[int]) -> Tensor:
    """One draw per row from softmax(x): Gumbel-max over blocks of ~sqrt(vocab) ids by log-mass, then within the
    block (exact, as softmax factorizes), so a row hashes ~2 sqrt(vocab) uniforms, not vocab."""
    rows, vocab = x.shape
    size = math.isqrt(vocab - 1) + 1  # ids per block
    blocks = -(-vocab // size)
    probs = torch.nn.functional.pad(x.softmax(dim=-1), (0, blocks * size - vocab))
    log_mass = probs.view(rows, blocks, size).sum(dim=-1).log_().double()  # [rows, blocks]; empty: -inf
    block_ids = torch.arange(blocks, device=x.device).expand(rows, blocks)
    block = (log_mass + gumbel_noise(row_keys(seeds, steps, 0), block_ids)).argmax(dim=-1)  # [rows]
    token_ids = block[:, None] * size + torch.arange(size, device=x.device)  # [rows, size]
    inner = x.gather(1, token_ids.clamp(max=vocab - 1)).masked_fill_(token_ids >= vocab, -math.inf).double()
    inner += gumbel_noise(row_keys(seeds, steps, 1), token_ids)
    return token_ids.gather(1, inner.argmax(dim=-1, keepdim=True)).squeeze(1)
