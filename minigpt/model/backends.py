"""Decode attention over the paged pool, one backend chosen when the engine starts.

Every backend has `store_kv(k, v, k_cache, v_cache, slot_mapping)` and `decode(query, k_cache,
v_cache, block_tables, context_lens, scale)`; one layer's pages are (blocks, block_size, H, D).
- `TorchBackend`: the PyTorch reference (kernels/reference.py); runs anywhere, never imports Triton.
- `compiled.CompiledDecodeBackend`: the same attention as one compiled graph that reads the pages in
  place (`compile=True` on the torch backend).
- `TritonBackend`: the Triton kernels of kernels/ (CUDA, or Triton's interpreter in tests).
"""

from __future__ import annotations

import torch

from minigpt.kernels import reference

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The engine's KV write: like `reference.store_kv`, minus its support for padding rows
    (slot -1), which the engine never emits and whose boolean masking copies every row."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class TorchBackend:
    """Decode attention through the PyTorch reference.

    The pages are gathered into a buffer kept for the engine's life (grown to the largest step so far),
    and converted into a second one when the pool's dtype is not the query's: a fresh tensor above
    glibc's mmap threshold would be mapped and page-faulted anew at every step."""

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
