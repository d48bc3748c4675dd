"""How a forward's tokens attend, as `Block.forward` calls it: `attention(layer, q, k, v)`, q, k, v (N, H, D) ->
(N, H * D). An engine step is a flat batch: the prompt chunks, then one token per decoding sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from minigpt.common.transfer import to_device


class FusedKernels(Protocol):
    """A block's elementwise steps fused (minigpt/kernels/fused_block.py), as `reference`'s functions of these names."""

    def layernorm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                  dtype: torch.dtype) -> torch.Tensor: ...

    def add_layernorm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def bias_gelu(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...


class Attention:
    """What `Block.forward` attends through: a layer's q, k, v (N, H, D) -> y (N, H * D); `fused`: the kernels the
    block around it runs its norms and GELU through (its backend's), or None for torch's."""

    fused: FusedKernels | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class PrefillSegment:
    """One sequence's prompt chunk: tokens [start, start + length) of the flat batch."""

    start: int
    length: int
    context_len: int  # cached prefix + chunk
    block_table: torch.Tensor  # [num_blocks] int64 covering context_len
    prompt_rows: int  # the chunk's first rows that are prompt positions; the rest were generated (recomputed, drafts)


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor  # [N] int64: where each token's K/V is written
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [B_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [B_decode] int32
    # the first `num_fresh` segments start their prompts (no cached prefix) and attend in one call
    num_fresh: int = 0

    @property
    def decode_only(self) -> bool:
        return not self.prefills


class CausalAttention(Attention):
    """A (B, T) batch among its own tokens; `mask` (B, 1, T, T) bool, or None for plain causal."""

    def __init__(self, batch: int, mask: torch.Tensor | None, scales: Sequence[float], upcast: bool) -> None:
        self.batch, self.mask, self.scales, self.upcast = batch, mask, scales, upcast

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tokens, heads, head_dim = q.shape
        q, k, v = (t.view(self.batch, -1, heads, head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        dtype = q.dtype
        if self.upcast:
            q, k, v = q.float(), k.float(), v.float()
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, is_causal=self.mask is None, scale=self.scales[layer]
        )
        return y.to(dtype).transpose(1, 2).reshape(tokens, -1)


class PagedAttention(Attention):
    """An engine step: its K/V stored in the pool, each prompt chunk through SDPA, the decodes through `backend`."""

    def __init__(self, kv_pool: torch.Tensor, meta: StepMetadata, backend, scales: Sequence[float],
                 upcast: bool) -> None:
        self.kv_pool, self.meta, self.backend, self.scales, self.upcast = kv_pool, meta, backend, scales, upcast
        self.fused = backend.fused
        self.fresh_mask = None
        if meta.num_fresh:
            self.fresh_mask = block_causal_mask([seg.length for seg in meta.prefills[: meta.num_fresh]], kv_pool.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, scale = self.meta, self.scales[layer]
        k_cache, v_cache = self.kv_pool[layer]
        self.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if k_cache.dtype != k.dtype:  # its own K/V as the pool keeps them, as later steps read them
            k, v = k.to(k_cache.dtype).to(k.dtype), v.to(v_cache.dtype).to(v.dtype)
        parts, segments = [], meta.prefills
        if self.fresh_mask is not None:
            fresh = self.fresh_mask.shape[0]
            parts.append(token_attention(q[:fresh], k[:fresh], v[:fresh], scale, self.upcast, self.fresh_mask))
            segments = segments[meta.num_fresh :]
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.length)
            parts.append(prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seg, scale, self.upcast))
        if meta.decode_block_tables is not None:
            parts.append(self.backend.decode(
                q[meta.num_prefill_tokens :], k_cache, v_cache, meta.decode_block_tables,
                meta.decode_context_lens, scale,
            ))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.to(q.dtype).reshape(q.shape[0], -1)


class InvariantAttention(PagedAttention):
    """`batch_invariant=True`: every query through `invariant_attention` over its blocks."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, scale = self.meta, self.scales[layer]
        k_cache, v_cache = self.kv_pool[layer]
        self.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        parts = [
            invariant_prefill(q[seg.start : seg.start + seg.length], k_cache, v_cache, seg, scale)
            for seg in meta.prefills
        ]
        if meta.decode_block_tables is not None:
            parts.append(invariant_decode(q[meta.num_prefill_tokens :], k_cache, v_cache, meta.decode_block_tables,
                                          meta.decode_context_lens, scale))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.to(q.dtype).reshape(q.shape[0], -1)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segment: PrefillSegment,
    scale: float,
    upcast: bool = False,
) -> torch.Tensor:
    """One prompt chunk, q/k/v [T, H, D] -> [T, H, D]; a cached prefix's keys from the blocks, masked by position."""
    length, context_len = segment.length, segment.context_len
    mask = None
    if context_len != length:
        num_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k = k_cache[segment.block_table].reshape(-1, num_heads, head_dim)[:context_len].to(q.dtype)
        v = v_cache[segment.block_table].reshape(-1, num_heads, head_dim)[:context_len].to(q.dtype)
        q_pos = torch.arange(context_len - length, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]  # (T, context_len)
    return token_attention(q, k, v, scale, upcast, mask)


def block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[F, F] bool for prompts of `lengths` end to end: each token sees its own prompt up to itself."""
    prompt = to_device([i for i, length in enumerate(lengths) for _ in range(length)], torch.int64, device)
    rows = torch.arange(len(prompt), device=device)
    return (prompt[:, None] == prompt[None, :]) & (rows[None, :] <= rows[:, None])


def token_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    upcast: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA of q [T, H, D] over k, v [S, H, D], causal or under (T, S) `mask`: 4-D eager (the CPU flash kernel's
    only form), 3-D compiled (the math path inductor fuses)."""
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if not torch.compiler.is_compiling():
        q, k, v = q[None], k[None], v[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.flatten(0, -3).transpose(0, 1)  # [1, H, T, D] or [H, T, D] -> [T, H, D]


INVARIANT_ROWS = 4  # queries in each of `invariant_attention`'s products
INVARIANT_KEYS = 64  # keys summed in each product of weights and values


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Rows the same bits whatever their neighbours: every product of one shape, q [B, H, R, D] against keys
    [B, H, P, K, D] and values with a column of ones (the denominator), row r of b seeing lengths[b, r] keys."""
    batch, heads, pieces, width, dim = keys.shape
    scores = torch.matmul(q.float()[:, :, None], keys.transpose(-1, -2)) * scale  # (B, H, P, R, K)
    position = torch.arange(pieces * width, device=q.device).view(pieces, 1, width)
    scores = scores.masked_fill(position >= lengths[:, None, None, :, None], float("-inf"))
    weights = torch.exp(scores - scores.amax((2, 4), keepdim=True))
    parts = torch.matmul(weights, values)  # (B, H, P, R, D + 1)
    total = parts[:, :, 0]
    for piece in range(1, pieces):
        total = total + parts[:, :, piece]
    return total[..., :dim] / total[..., dim:]


def invariant_keys(cache: torch.Tensor, tables: torch.Tensor, ones: bool = False) -> torch.Tensor:
    """One layer's keys or values at `tables` [B, W] as `invariant_attention` takes them (`ones`: values)."""
    blocks = cache[tables]  # (B, W, block_size, H, D)
    batch, width, block_size, heads, dim = blocks.shape
    out = blocks.new_empty(batch, heads, width * block_size, dim + ones, dtype=torch.float32)
    out[..., :dim].view(batch, heads, width, block_size, dim).copy_(blocks.permute(0, 3, 1, 2, 4))
    if ones:
        out[..., dim] = 1.0
    return out.view(batch, heads, -1, INVARIANT_KEYS, dim + ones)


def _whole_pieces(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block tables [B, W] padded with block 0 (never attended to) to whole INVARIANT_KEYS tokens."""
    blocks = -(-INVARIANT_KEYS // block_size)
    return F.pad(tables, (0, -tables.shape[1] % blocks))


def invariant_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segment: PrefillSegment,
                      scale: float) -> torch.Tensor:
    """A prompt chunk q [T, H, D] (its K/V stored), INVARIANT_ROWS queries at a time -> [T, H, D] fp32."""
    length, context_len = segment.length, segment.context_len
    tables = _whole_pieces(segment.block_table[None], k_cache.shape[1])
    keys, values = invariant_keys(k_cache, tables), invariant_keys(v_cache, tables, ones=True)
    seen = torch.arange(context_len - length + 1, context_len + 1, device=q.device)
    rows = F.pad(q, (0, 0, 0, 0, 0, -length % INVARIANT_ROWS)).transpose(0, 1)[None]  # (1, H, T', D)
    lengths = F.pad(seen, (0, -length % INVARIANT_ROWS), value=1)
    out = []
    for start in range(0, length, INVARIANT_ROWS):
        tile = lengths[start : start + INVARIANT_ROWS]
        used = -(-int(tile.max()) // INVARIANT_KEYS)  # the pieces holding a key this tile sees
        out.append(invariant_attention(rows[:, :, start : start + INVARIANT_ROWS], keys[:, :, :used],
                                       values[:, :, :used], tile[None], scale))
    return torch.cat(out, 2)[0, :, :length].transpose(0, 1)


def invariant_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decodes q [B, H, D] (K/V stored), each the first of its own INVARIANT_ROWS -> [B, H, D] fp32."""
    tables = _whole_pieces(block_tables.long(), k_cache.shape[1])
    keys, values = invariant_keys(k_cache, tables), invariant_keys(v_cache, tables, ones=True)
    rows = F.pad(q[:, :, None], (0, 0, 0, INVARIANT_ROWS - 1))  # (B, H, R, D)
    lengths = torch.ones(len(q), INVARIANT_ROWS, dtype=context_lens.dtype, device=q.device)
    lengths[:, 0] = context_lens
    return invariant_attention(rows, keys, values, lengths, scale)[:, :, 0]
