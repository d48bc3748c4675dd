"""The compiled steps' attention (minigpt.compile.steps): a decode row over its blocks (`PoolAttention`, `attend`: sums
inductor fuses with the block reads), a prompt row in pieces of PROMPT_PIECE positions (`prompt_attention`: the same
bits however the prompt is chunked)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minigpt.model.attention import Attention


class PoolAttention(Attention):
    """One new token per sequence over its blocks and its own K/V (counted in context_lens), writing them only where
    `stores_kv`, else keeping them for its caller to store: `new_kv` [2, B, H, D], of the pool's dtype."""

    stores_kv = False

    def __init__(self, kv_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scales: torch.Tensor) -> None:
        self.kv_pool, self.scales = kv_pool, scales
        self.tables = block_tables.long()
        self.cached = in_context(block_tables, context_lens - 1, kv_pool.shape[3])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype, pool = q.dtype, self.kv_pool[layer]
        self.new_kv = None if self.stores_kv else torch.stack([k, v]).to(pool.dtype)
        q, k, v = q.float() * self.scales[layer], k.to(pool.dtype).float(), v.to(pool.dtype).float()
        return self.over_blocks(pool, q, k, v).to(dtype).reshape(q.shape[0], -1)

    def over_blocks(self, pool: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scaled fp32 queries q [B, H, D] and their own k, v (as the pool keeps them, in fp32) over this layer's
        `pool` [2, blocks, block_size, H, D] -> [B, H, D] fp32."""
        return attend(q, pool[0][self.tables].float(), pool[1][self.tables].float(), self.cached, k, v)


def in_context(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which slots of the blocks (B, W, block_size) hold one of the first `lengths` tokens."""
    width = block_tables.shape[1]
    slots = torch.arange(width * block_size, device=block_tables.device).view(1, width, block_size)
    return slots < lengths[:, None, None]


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cached: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled fp32 queries (B, H, D) over blocks (B, W, block_size, H, D) where `cached`, and their own k, v if
    given -> (B, H, D): products and sums inductor fuses with the block reads, each block summed first."""
    scores = (q[:, None, None] * keys).sum(-1).masked_fill(~cached[..., None], float("-inf"))
    top = scores.amax((1, 2))
    if k is not None:
        own = (q * k).sum(-1)  # (B, H)
        top = torch.maximum(top, own)
    weights = torch.exp(scores - top[:, None, None])
    total = weights.sum((1, 2))
    by_block = (weights[..., None] * values).sum(2)  # (B, W, H, D)
    if k is None:
        return by_block.sum(1) / total[..., None]
    own_weight = torch.exp(own - top)
    return (by_block.sum(1) + own_weight[..., None] * v) / (total + own_weight)[..., None]


PROMPT_PIECE = 32  # query positions in each of `prompt_attention`'s calls


def causal_mask(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[size, size] additive mask: position i sees positions <= i."""
    return torch.full((size, size), float("-inf"), dtype=dtype, device=device).triu(1)


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, first: int,
                     scale: float, causal: torch.Tensor) -> torch.Tensor:
    """Prompt positions [first, first + T) q [T, H, D] (their K/V stored) -> [T, H, D], each row the same bits
    however the prompt is chunked: SDPA of the PROMPT_PIECE positions its piece holds over the keys up to the
    piece's end, so every call's shapes follow the piece alone. `causal`: a `causal_mask` past the last piece,
    of the dtype attention runs in."""
    end, dtype = first + len(q), causal.dtype
    low, high = first // PROMPT_PIECE, -(-end // PROMPT_PIECE)
    span, offset = high * PROMPT_PIECE, first - low * PROMPT_PIECE
    heads, dim = k_cache.shape[2:]

    def padded(rows: torch.Tensor, start: int, size: int) -> torch.Tensor:  # (1, H, size, D), zeros elsewhere
        out = rows.new_zeros(size, heads, dim, dtype=dtype)
        out[start : start + len(rows)] = rows
        return out.transpose(0, 1)[None]

    # the blocks' stale slots past `end` may hold anything, NaN included: zeros instead
    keys, values = (padded(cache[table].view(-1, heads, dim)[:end], 0, span) for cache in (k_cache, v_cache))
    rows = padded(q, offset, span - low * PROMPT_PIECE)  # whole pieces
    out = []
    for piece in range(low, high):
        seen = (piece + 1) * PROMPT_PIECE
        at = (piece - low) * PROMPT_PIECE
        mask = causal[seen - PROMPT_PIECE : seen, :seen]
        out.append(F.scaled_dot_product_attention(rows[:, :, at : at + PROMPT_PIECE], keys[:, :, :seen],
                                                  values[:, :, :seen], attn_mask=mask, scale=scale))
    return torch.cat(out, 2)[0, :, offset : offset + len(q)].transpose(0, 1).to(q.dtype)
