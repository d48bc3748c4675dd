"""Decode attention over the paged pool, one backend chosen at start (with the kernels, if any, its blocks fuse their
norms and GELU through): `store_kv(k, v, k_cache, v_cache, slots)` and
`decode(query, k_cache, v_cache, block_tables, context_lens, scale)`, a layer's caches (blocks, block_size, H, D)."""

from __future__ import annotations

import torch

from minigpt.kernels import reference

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`reference.store_kv` without padding rows (slot -1), whose masking copies every row."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class TorchBackend:
    """kernels/reference.py, its gather buffers kept (a fresh one above glibc's mmap threshold page-faults)."""

    name = "torch"
    store_kv = staticmethod(store_kv)
    fused = None  # the blocks' norms and GELU in torch

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
        self.workspace = self.converted = torch.empty(0)


def _at_least(buffer: torch.Tensor, numel: int, like: torch.Tensor) -> torch.Tensor:
    """`buffer`, or a new one where it lacks `like`'s dtype, device or `numel` elements."""
    if buffer.dtype == like.dtype and buffer.device == like.device and buffer.numel() >= numel:
        return buffer
    return torch.empty(numel, dtype=like.dtype, device=like.device)


class TritonBackend:
    """The Triton kernels: on CUDA, or under Triton's interpreter (TRITON_INTERPRET=1) in tests."""

    name = "triton"

    def __init__(self) -> None:
        from triton.runtime import JITFunction

        from minigpt.kernels import fused_block, kv_store, paged_attention

        self.store_kv = kv_store.store_kv
        self.decode = paged_attention.paged_decode_attention
        # triton.jit reads TRITON_INTERPRET when it decorates
        self.interpreted = not isinstance(paged_attention._paged_decode_kernel, JITFunction)
        self.fused = None if self.interpreted else fused_block  # on CUDA: the blocks' norms and GELU fused too

    def close(self) -> None:
        pass


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
