"""How a forward's tokens attend, as `GPT2.run`'s layer loop calls it: `attention(layer, q, k, v) -> y`, q, k, v
(N, H, D) for the step's N tokens, y (N, H * D). A step is a flat batch: the prompt chunks, then one token
per decoding sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minigpt.common.transfer import to_device


def attention_inputs(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block up to its attention: residual stream (N, C) -> q, k, v (N, nh, hs)."""
    return block.attn.qkv(block.ln_1(x).to(block.dtype))


def attention_outputs(block, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A block after its attention: stream x and attention output y (N, C) -> the next stream."""
    return block.add_mlp(x + block.attn.c_proj(y))


Halves = tuple[Callable, Callable]
EAGER_HALVES: Halves = (attention_inputs, attention_outputs)


class Attention:
    """`block` runs one block of the layer loop around this attention through `halves` (compiled programs in
    a compiled engine); `head` the final norm and LM head. A compiled decode overrides both."""

    halves: Halves = EAGER_HALVES

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block(self, layer: int, block, x: torch.Tensor, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """x (N, C) -> the next x; only `rows` go on past the attention (the last layer's logits rows)."""
        before, after = self.halves
        q, k, v = before(block, x)
        y = self(layer, q, k, v)
        if rows is not None:
            x, y = x[rows], y[rows]
            if not len(x):  # a prompt chunk that samples nothing: no logits to compute
                return x
        return after(block, x, y)

    def head(self, model, x: torch.Tensor) -> torch.Tensor:
        return model.head(x)


@dataclass
class PrefillSegment:
    """One sequence's prompt chunk in a step: tokens [start, start + length) of the flat batch."""

    start: int
    length: int
    context_len: int  # tokens of this sequence in the cache after this step (cached prefix + chunk)
    block_table: torch.Tensor | None  # [num_blocks] int64: its pages covering context_len; None without a cached prefix


@dataclass
class StepMetadata:
    """Everything attention needs for one step, built once per step by the model runner."""

    slot_mapping: torch.Tensor  # [N] int64: where each token's K/V is written
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [B_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [B_decode] int32
    # the first `num_fresh` segments start their prompts (no cached prefix) and attend in one call
    num_fresh: int = 0

    @property
    def decode_only(self) -> bool:
        """One new token per sequence, no prompt chunk: the step the compiled programs and CUDA graphs take."""
        return not self.prefills


class CausalAttention(Attention):
    """A (B, T) batch attending among its own tokens; `mask` (B, 1, T, T) bool, or None for plain causal."""

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
    """One engine step's attention over the pool: the step's K/V stored at their slots, each prompt chunk
    through SDPA, the decodes through `backend`. kv_pool: (n_layer, 2, blocks, block_size, H, D)."""

    def __init__(self, kv_pool: torch.Tensor, meta: StepMetadata, backend, scales: Sequence[float],
                 upcast: bool, halves: Halves = EAGER_HALVES) -> None:
        self.kv_pool, self.meta, self.backend, self.scales, self.upcast = kv_pool, meta, backend, scales, upcast
        self.halves = halves
        self.fresh_mask = None
        if meta.num_fresh:
            self.fresh_mask = block_causal_mask([seg.length for seg in meta.prefills[: meta.num_fresh]], kv_pool.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, scale = self.meta, self.scales[layer]
        k_cache, v_cache = self.kv_pool[layer]
        self.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if k_cache.dtype != k.dtype:  # the chunk attends to its K/V as the pool keeps them, as later steps read them
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
            # the decode backends accumulate in fp32 whatever the dtype: upcasting is built in
            parts.append(self.backend.decode(
                q[meta.num_prefill_tokens :], k_cache, v_cache, meta.decode_block_tables,
                meta.decode_context_lens, scale,
            ))
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.to(q.dtype).reshape(q.shape[0], -1)


class InvariantAttention(PagedAttention):
    """`PagedAttention` for `batch_invariant=True`: every query, of a prompt chunk or a decode, attends
    through `invariant_attention` over its sequence's pages, so a token's attention is the same bits
    whichever step computes it and whatever else that step holds. Every prompt chunk has its pages."""

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


class PoolAttention(Attention):
    """One new token per sequence over its cached pages and itself, reading the pool, never writing it.

    kv_pool: (n_layer, 2, blocks, block_size, H, D); block_tables: [B, W]; context_lens: [B] tokens
    including this step's, whose own K/V is not in the pages yet; scales: [n_layer] fp32 tensor."""

    def __init__(self, kv_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scales: torch.Tensor) -> None:
        self.kv_pool, self.scales = kv_pool, scales
        self.pages = block_tables.long()
        self.cached = in_context(block_tables, context_lens - 1, kv_pool.shape[3])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dtype, pool = q.dtype, self.kv_pool[layer]
        # its own K/V as the pool keeps them, as a step among prompts reads them from there
        q, k, v = q.float() * self.scales[layer], k.to(pool.dtype).float(), v.to(pool.dtype).float()
        y = attend(q, pool[0][self.pages].float(), pool[1][self.pages].float(), self.cached, k, v)
        return y.to(dtype).reshape(q.shape[0], -1)


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
    """Causal attention of one prompt chunk. q/k/v: [T, H, D] for the chunk -> [T, H, D].

    Without a cached prefix the chunk attends to itself (plain causal). With one (chunked prefill, a
    prefix-cache hit) keys come from the pages, converted to the query's dtype, and the mask from
    positions: SDPA's `is_causal` aligns its mask top-left, wrong when keys outnumber queries.
    `upcast` (GPT-2's reorder_and_upcast_attn) computes scores and softmax in fp32.
    """
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
    """[F, F] bool for prompts of `lengths` (F tokens in all) laid end to end: each token sees its own
    prompt's tokens up to itself."""
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
    """SDPA over flat tokens: q [T, H, D] against k, v [S, H, D] -> [T, H, D]. Plain causal when
    `mask` is None, else the boolean (T, S) mask; `upcast` computes in fp32.

    Eager, the heads go in as a batch of one, [1, H, T, D]: torch's CPU flash kernel takes only 4-D
    inputs. Compiled, they stay 3-D: inductor fuses the math path, where the flash kernel stays a call."""
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if not torch.compiler.is_compiling():
        q, k, v = q[None], k[None], v[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.flatten(0, -3).transpose(0, 1)  # [1, H, T, D] or [H, T, D] -> [T, H, D]


def in_context(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which slots of each sequence's pages (B, W, block_size) hold one of its first `lengths` tokens."""
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
    """One fp32 query per sequence (B, H, D), already scaled, over the keys and values of its pages
    (B, W, block_size, H, D) where `cached` (B, W, block_size) holds, and over its own key and value
    k, v (B, H, D) when they are not in the pages: one softmax over both -> (B, H, D).

    Products and sums, not SDPA: the form inductor fuses with the page reads. Each page is summed
    before the pages are: over all W * block_size tokens at once, inductor's innermost loop would look
    up the page for every few floats."""
    scores = (q[:, None, None] * keys).sum(-1).masked_fill(~cached[..., None], float("-inf"))
    top = scores.amax((1, 2))
    if k is not None:
        own = (q * k).sum(-1)  # (B, H): the query against its own key
        top = torch.maximum(top, own)
    weights = torch.exp(scores - top[:, None, None])
    total = weights.sum((1, 2))
    by_page = (weights[..., None] * values).sum(2)  # (B, W, H, D)
    if k is None:
        return by_page.sum(1) / total[..., None]
    own_weight = torch.exp(own - top)
    return (by_page.sum(1) + own_weight[..., None] * v) / (total + own_weight)[..., None]


def paged_decode(
    query: torch.Tensor,
    pages: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    first_pages: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """Decode attention with this step's K/V already stored, in the form inductor fuses with the page
    reads: one query per sequence (B, H, D) over the first `context_lens` tokens of its pages -> (B, H, D)
    in the query's dtype. pages: the whole pool as pages, (n_layer * 2 * blocks, block_size, H, D);
    first_pages: [2] int64, where this layer's key and value pages start in it; scale: a 0-d tensor."""
    tables = block_tables.long()
    keys = pages[tables + first_pages[0]].float()
    values = pages[tables + first_pages[1]].float()
    cached = in_context(block_tables, context_lens, pages.shape[1])
    return attend(query.float() * scale, keys, values, cached).to(query.dtype)


INVARIANT_ROWS = 4  # queries in each of `invariant_attention`'s products
INVARIANT_KEYS = 64  # keys summed in each product of weights and values


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Attention whose every row is computed the same way whatever the rows beside it and the keys past its
    length: q [B, H, INVARIANT_ROWS, D] against keys [B, H, P, INVARIANT_KEYS, D] and values with a column
    of ones [B, H, P, INVARIANT_KEYS, D + 1] (`invariant_keys`), row r of b seeing the first lengths[b, r] >= 1
    keys -> [B, H, INVARIANT_ROWS, D] fp32.

    A float matrix product's reduction order follows its shapes, so every product here has the same shapes
    whatever the batch: INVARIANT_ROWS rows against INVARIANT_KEYS keys, the weighted values of each
    INVARIANT_KEYS keys then added in order (a key past a row's length adds an exact zero). The softmax's
    denominator is summed with the values, by their column of ones."""
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
    """The pages of `tables` [B, W] (W * block_size a multiple of INVARIANT_KEYS) of one layer's keys or
    values (blocks, block_size, H, D) as `invariant_attention` takes them: fp32 [B, H, P, INVARIANT_KEYS, D],
    values with a column of ones after their D."""
    pages = cache[tables]  # (B, W, block_size, H, D)
    batch, width, block_size, heads, dim = pages.shape
    out = pages.new_empty(batch, heads, width * block_size, dim + ones, dtype=torch.float32)
    out[..., :dim].view(batch, heads, width, block_size, dim).copy_(pages.permute(0, 3, 1, 2, 4))
    if ones:
        out[..., dim] = 1.0
    return out.view(batch, heads, -1, INVARIANT_KEYS, dim + ones)


def _whole_pieces(tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block tables [B, W] with pages added (page 0: never attended to) up to whole INVARIANT_KEYS tokens
    (EngineConfig has a block_size that divides INVARIANT_KEYS or that it divides)."""
    pages = -(-INVARIANT_KEYS // block_size)
    return F.pad(tables, (0, -tables.shape[1] % pages))


def invariant_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, segment: PrefillSegment,
                      scale: float) -> torch.Tensor:
    """A prompt chunk q [T, H, D] through `invariant_attention` over its pages (the chunk's K/V stored),
    INVARIANT_ROWS queries at a time, each against the keys up to the last one it sees -> [T, H, D] fp32."""
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
    """Decodes q [B, H, D] (this step's K/V stored) through `invariant_attention`, each query the first
    row of its own INVARIANT_ROWS -> [B, H, D] fp32."""
    tables = _whole_pieces(block_tables.long(), k_cache.shape[1])
    keys, values = invariant_keys(k_cache, tables), invariant_keys(v_cache, tables, ones=True)
    rows = F.pad(q[:, :, None], (0, 0, 0, INVARIANT_ROWS - 1))  # (B, H, R, D)
    lengths = torch.ones(len(q), INVARIANT_ROWS, dtype=context_lens.dtype, device=q.device)
    lengths[:, 0] = context_lens
    return invariant_attention(rows, keys, values, lengths, scale)[:, :, 0]
