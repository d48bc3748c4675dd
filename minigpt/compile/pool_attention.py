"""The compiled decode's attention on x86 CPUs with AVX2: the kernel of kernels/pool_attention_avx2.cpp, which reads a
sequence's blocks in order, a slot's heads side by side, in splits of 32 tokens, where inductor's code of `attend`
walks them head by head (scripts/PERFORMANCE.md, "Decode attention"). The splits follow positions and merge in order
in fp32 whatever the batch, so a sequence's bits are the same alone and in any batch, as with `attend`; the two
differ in rounding.

Used where `usable(pool)`; `MINIGPT_NATIVE_KERNELS=0` (`cpu_class.NATIVE_SWITCH`) turns it off (`attend` then)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from minigpt import kernels
from minigpt.common.cpu_class import native_kernels_on, usable_flags
from minigpt.compile.attention import PoolAttention
from minigpt.compile.native import loads

SOURCE = Path(kernels.__file__).parent / "pool_attention_avx2.cpp"
FLAGS = ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2")
NEEDS = frozenset({"avx2", "fma", "f16c"})  # the CPU flags FLAGS compile for
LANES = 8  # floats in an AVX2 register: the head size must be a multiple
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def usable(pool: torch.Tensor) -> bool:
    """The kernel serves this KV pool ([layers, 2, blocks, block_size, H, D]): a CPU one of a dtype it reads, heads
    of a multiple of 8, a CPU with AVX2, FMA and F16C, the switch not off, and the library built and loaded."""
    return (
        pool.device.type == "cpu"
        and pool.dtype in POOL_DTYPES
        and pool.shape[-1] % LANES == 0
        and NEEDS <= (usable_flags() or frozenset())
        and native_kernels_on()
        and loaded()
    )


@functools.cache
def loaded() -> bool:
    return loads(SOURCE, FLAGS, "inductor's code of the decode attention",
                 {"minigpt_cpu::pool_decode_attention": _decode_shape})


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    tables: torch.Tensor,
    cached: torch.Tensor,
) -> torch.Tensor:
    """Scaled queries q [B, H, D] and their own k, v (fp32, values of the pool's dtype) over `cached` [B] tokens in
    the blocks `tables` [B, W] (int32) of one layer's keys and values `pool` [2, blocks, block_size, H, D] -> [B, H, D]
    fp32; k and v are then stored in the pool at position `cached` of each sequence's blocks."""
    if not loaded():  # loaded where `usable` was asked; a compile worker loads it here
        raise RuntimeError("the C++ decode attention could not be loaded in this process")
    return torch.ops.minigpt_cpu.pool_decode_attention(q, k, v, pool, tables, cached)


def _decode_shape(q, k, v, pool, tables, cached) -> torch.Tensor:
    return torch.empty_like(q)


class NativePoolAttention(PoolAttention):
    """`PoolAttention` with its blocks attended through the kernel, which also stores the new K/V."""

    stores_kv = True

    def __init__(
        self, kv_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scales: torch.Tensor
    ) -> None:
        self.kv_pool, self.scales = kv_pool, scales  # the kernel's own inputs instead of PoolAttention's
        self.tables, self.cached = block_tables.int(), (context_lens - 1).int()

    def over_blocks(self, pool: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return decode(q, k, v, pool, self.tables, self.cached)
