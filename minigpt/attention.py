"""Attention over the paged KV pool: what one engine step needs besides the weights.

A step is a flat batch of tokens: first the prompt chunks being prefilled (one segment per
sequence), then one token per decoding sequence. `StepMetadata` says where each token's K/V
goes (slot mapping) and which pages each query reads. Prefill runs through SDPA with a mask
built from positions (never `is_causal` when keys outnumber queries: SDPA aligns that mask
top-left, which is wrong after a cached prefix). Decode runs through a backend: the torch
reference or the Triton kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minigpt.kernels import reference

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class PrefillSegment:
    """One sequence's prompt chunk in a step: tokens [start, start + length) of the flat batch."""

    start: int
    length: int
    context_len: int  # tokens of this sequence in the cache after this step (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] int64: the sequence's pages covering context_len


@dataclass
class StepMetadata:
    """Everything attention needs for one step, built once per step by the engine."""

    slot_mapping: torch.Tensor  # [N] int64: where each token's K/V is written
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    decode_block_tables: torch.Tensor | None  # [B_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None  # [B_decode] int32


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The engine's KV write: like `reference.store_kv`, minus its support for padding rows
    (slot -1), which the engine never emits and whose boolean masking copies every row."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class TorchBackend:
    """Decode attention through the PyTorch reference: runs anywhere, never imports Triton.

    Each layer's pages are gathered into one buffer kept for the engine's life (grown to the largest
    step so far: two copies of one layer's pages for every decoding sequence), and converted into a
    second one when the pool's dtype is not the query's (`kv_cache_dtype`). A new tensor each time
    is worse than it looks: above glibc's mmap threshold (32 MB, e.g. gpt2 at batch 100 and 112
    tokens) every allocation is mapped afresh and page-faulted as it is written, 19 vs 3 ms to gather
    34 MB on 2 cores, which doubled the eager step as contexts grew.
    """

    name = "torch"
    store_kv = staticmethod(store_kv)

    def __init__(self) -> None:
        self.workspace = torch.empty(0)
        self.converted = torch.empty(0)

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        needed = 2 * block_tables.numel() * k_cache[0].numel()
        self.workspace = _at_least(self.workspace, needed, k_cache)
        converted = None
        if query.dtype != k_cache.dtype:
            self.converted = converted = _at_least(self.converted, needed, query)
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, self.workspace, converted
        )

    def close(self) -> None:
        """Free the gather buffers (the engine is closing)."""
        self.workspace = self.converted = torch.empty(0)


def _at_least(buffer: torch.Tensor, numel: int, like: torch.Tensor) -> torch.Tensor:
    """`buffer` if it has `like`'s dtype and device and room for `numel` elements, else a new one that has."""
    if buffer.dtype == like.dtype and buffer.device == like.device and buffer.numel() >= numel:
        return buffer
    return torch.empty(numel, dtype=like.dtype, device=like.device)


class TritonBackend:
    """Decode attention and KV stores through the Triton kernels: compiled on CUDA; on other devices
    only under Triton's interpreter (TRITON_INTERPRET=1 before triton is first imported), for tests."""

    name = "triton"

    def __init__(self) -> None:
        from triton.runtime import JITFunction

        from minigpt.kernels import kv_store, paged_attention

        self.store_kv = kv_store.store_kv
        self.decode = paged_attention.paged_decode_attention
        # triton.jit reads TRITON_INTERPRET when it decorates: the kernels' type says which way they went.
        self.interpreted = not isinstance(paged_attention._paged_decode_kernel, JITFunction)

    def close(self) -> None:
        """Nothing to free: the kernels keep no buffers."""


def select_backend(name: str, device: torch.device) -> TorchBackend | TritonBackend:
    """`auto` takes Triton on CUDA when it imports, the torch reference elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchBackend()
    try:
        backend = TritonBackend()
    except ImportError as err:
        if name == "auto":
            return TorchBackend()
        raise ValueError(f"attention_backend='triton' is unavailable: {err} (pip install 'minigpt[triton]')") from None
    if device.type != "cuda" and not backend.interpreted:
        raise ValueError(
            f"attention_backend='triton' on device {device.type!r} runs only under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before triton is first imported, or use attention_backend='torch'"
        )
    return backend


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

    Without a cached prefix the chunk attends to itself (plain causal). With one (chunked
    prefill, prefix-cache hit) keys come from the pages, converted to the query's dtype, and the
    mask from positions.
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

    Eager, the heads go in as a batch of one, [1, H, T, D], because torch's CPU flash kernel takes
    only 4-D inputs; 3-D ones take its math path, 2.5-3.5x slower eagerly (8-200 tokens, 12 heads,
    2 cores). Compiled, they stay 3-D: inductor fuses the math path, where the flash kernel stays a
    call of its own (a lone 8-token prompt's first token 0.2 ms later with it)."""
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    if not torch.compiler.is_compiling():
        q, k, v = q[None], k[None], v[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.flatten(0, -3).transpose(0, 1)  # [1, H, T, D] or [H, T, D] -> [T, H, D]
