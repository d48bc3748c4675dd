"""PyTorch references for the paged-KV kernels; also the engine's CPU ("torch") attention backend.

KV pool layout, per layer: ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, n_head, head_dim]``.
Token ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``;
its slot is ``block * block_size + offset``.

Pure torch: this module must never import triton.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the K/V rows of a step into their cache slots, in place.

    key, value: [N, H, D]; k_cache, v_cache: [num_blocks, block_size, H, D];
    slot_mapping: [N] int64, a slot per row, -1 for a padding row that is not written.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def gather_kv(cache: Tensor, block_tables: Tensor, out: Tensor | None = None) -> Tensor:
    """The pages of each sequence laid end to end.

    cache: [num_blocks, block_size, H, D]; block_tables: [B, max_blocks] -> [B, H, max_blocks * block_size, D]
    (a transposed view of one contiguous copy: index_select is faster on the CPU than advanced indexing).
    `out`: a flat buffer of at least B * max_blocks pages to copy into, instead of a new tensor.
    """
    batch, width = block_tables.shape
    index = block_tables.flatten().long()
    if out is None:
        pages = cache.index_select(0, index)  # (B * max_blocks, block_size, H, D)
    else:
        pages = out[: index.numel() * cache[0].numel()].view(index.numel(), *cache.shape[1:])
        torch.index_select(cache, 0, index, out=pages)
    return pages.view(batch, width * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _converted(pages: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
    """`gather_kv`'s pages (a transposed view of contiguous pages) in `dtype`, copied into the flat
    buffer `out` when one is given, in the same layout."""
    if out is None:
        return pages.to(dtype)
    contiguous = pages.transpose(1, 2)
    return out[: pages.numel()].view(contiguous.shape).copy_(contiguous).transpose(1, 2)


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    workspace: Tensor | None = None,
    converted: Tensor | None = None,
) -> Tensor:
    """One query token per sequence attending to the first ``context_lens[b]`` tokens of its pages.

    query: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, H, D];
    block_tables: [B, max_blocks] int32 (entries past a sequence's length may be any valid block);
    context_lens: [B] int32. Returns [B, H, D] in the query's dtype. A row with context_len 0 returns zeros.
    workspace: a flat buffer of the caches' dtype with room for 2 * B * max_blocks pages, to gather the
    keys and values into instead of new tensors (see `minigpt.model.attention.TorchBackend`); `converted`:
    the same of the query's dtype, for pages of another dtype converted to it.

    Half inputs go to SDPA as they are: its kernels compute scores, softmax and the weighted sum in
    fp32 and round the probabilities to the input dtype before that sum, as transformers'
    `reorder_and_upcast_attn` does. Upcasting the gathered pages first cost 6x the attention itself
    (bf16, batch 100, 112 tokens: 27 ms vs 4.4 ms a layer on 2 cores).
    Pages of another dtype than the query (a half-precision pool under a float32 model) are converted
    to the query's dtype once gathered.
    """
    keys_out, values_out = (None, None) if workspace is None else workspace.chunk(2)  # gather_kv takes what it needs
    keys = gather_kv(k_cache, block_tables, keys_out)  # (B, H, L, D)
    values = gather_kv(v_cache, block_tables, values_out)
    if keys.dtype != query.dtype:
        keys_out, values_out = (None, None) if converted is None else converted.chunk(2)
        keys, values = _converted(keys, query.dtype, keys_out), _converted(values, query.dtype, values_out)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = positions[None, :] < context_lens[:, None]  # (B, L)
    out = F.scaled_dot_product_attention(
        query[:, :, None], keys, values, attn_mask=mask[:, None, None], scale=scale
    )[:, :, 0]  # (B, H, D)
    out = out.masked_fill(context_lens[:, None, None] <= 0, 0.0)
    return out
