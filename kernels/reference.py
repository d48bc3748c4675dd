"""PyTorch references for the paged-KV kernels, and the "torch" attention backend, and for the block's fused
elementwise kernels (fused_block.py); never imports triton.

k_cache, v_cache: [num_blocks, block_size, H, D]; token p sits in block block_table[p // block_size], and its
slot is block * block_size + p % block_size."""

import torch
import torch.nn.functional as F
from torch import Tensor


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """In place. key, value: [N, H, D]; slot_mapping: [N] int64, -1 for a padding row not written."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def gather_kv(cache: Tensor, block_tables: Tensor, out: Tensor | None = None) -> Tensor:
    """block_tables: [B, max_blocks] -> [B, H, max_blocks * block_size, D], a transposed view of contiguous
    blocks (index_select beats advanced indexing on the CPU), in the flat buffer `out` when given."""
    batch, width = block_tables.shape
    index = block_tables.flatten().long()
    if out is None:
        blocks = cache.index_select(0, index)  # (B * max_blocks, block_size, H, D)
    else:
        blocks = out[: index.numel() * cache[0].numel()].view(index.numel(), *cache.shape[1:])
        torch.index_select(cache, 0, index, out=blocks)
    return blocks.view(batch, width * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _converted(gathered: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
    if out is None:
        return gathered.to(dtype)
    contiguous = gathered.transpose(1, 2)
    return out[: gathered.numel()].view(contiguous.shape).copy_(contiguous).transpose(1, 2)


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
    """query [B, H, D] attends to the first context_lens[b] tokens of its blocks -> [B, H, D] (zeros for 0).

    block_tables: [B, max_blocks] int32; context_lens: [B] int32. workspace / converted: flat buffers for
    2 * B * max_blocks blocks, of the caches' / the query's dtype. Half blocks go to SDPA as they are (it
    computes in fp32); blocks of another dtype than the query are converted once gathered.
    """
    keys_out, values_out = (None, None) if workspace is None else workspace.chunk(2)
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


def layernorm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """x's layernorm over the last dim, computed in fp32, in `dtype`."""
    return F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps).to(dtype)


def add_layernorm(x: Tensor, delta: Tensor, weight: Tensor, bias: Tensor, eps: float,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(x + delta in x's dtype, its layernorm in `dtype`): a block's residual add and the norm after it."""
    total = x + delta.to(x.dtype)
    return total, layernorm(total, weight, bias, eps, dtype)


def bias_gelu(h: Tensor, bias: Tensor) -> Tensor:
    """GPT-2's gelu_new (the tanh approximation) of h + bias, computed in fp32, in h's dtype."""
    return F.gelu(h.float() + bias.float(), approximate="tanh").to(h.dtype)
