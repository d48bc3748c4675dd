"""Inputs and tolerances shared by the kernel tests (``test_kernels.py``, ``kernel_cases.py``). No triton
import at module level."""

import math
import os
from types import SimpleNamespace

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def import_triton_for_tests():
    """Import triton for a child-process test module: on the CPU under its interpreter, which has to be
    switched on before triton's first import (``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates)."""
    if DEVICE == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    triton = pytest.importorskip("triton")
    if DEVICE == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: run this file on its own")
    return triton


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel vs reference, and reference vs float64 attention on the same inputs: both accumulate in fp32,
# so the outputs differ by about one rounding to the output dtype (|out| stays below ~4 here).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def make_pool(
    context_lens: list[int], block_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> SimpleNamespace:
    """A KV pool with shuffled blocks for sequences of ``context_lens``, and one query per sequence.

    Returns query [B, H, D], k_cache/v_cache [num_blocks, block_size, H, D], block_tables [B, width] int32,
    context_lens [B] int32 and scale. Each block table has two spare entries past what its sequence needs,
    pointing at random valid blocks (even ones other sequences use), which the kernels must mask.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    width = max(math.ceil(n / block_size) for n in context_lens) + 2
    num_blocks = batch * width + 3
    shape = (num_blocks, block_size, num_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    for b, n in enumerate(context_lens):
        used = math.ceil(n / block_size)
        block_tables[b, used:] = torch.randint(num_blocks, (width - used,), generator=gen)
    query = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    return SimpleNamespace(
        query=query.to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_tables=block_tables.to(torch.int32).to(DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        scale=head_dim**-0.5,
    )


def decode_args(p: SimpleNamespace) -> tuple:
    """The positional arguments of ``paged_decode_attention`` for inputs from ``make_pool``."""
    return p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale


def fused_kv_rows(num_rows: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """key, value [N, H, D] as strided views into one [N, 3 * H * D] tensor, like a fused qkv projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_rows, 3 * num_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    _, key, value = (t.view(num_rows, num_heads, head_dim) for t in qkv.split(num_heads * head_dim, dim=1))
    return key, value
