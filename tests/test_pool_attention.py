"""The compiled decode's C++ attention (kernels/pool_attention_avx2.cpp): `PoolAttention`'s results to fp32 rounding
for every pool dtype, length and block layout it meets; the new K/V stored in their slots and nothing else written; a
sequence's bits the same alone, in any batch and on any number of threads; its refusals; where the compiled steps
take it."""

from __future__ import annotations

import pytest
import torch

from minigpt.common import cpu_class
from minigpt.compile import pool_attention
from minigpt.compile.attention import PoolAttention
from minigpt.compile.pool_attention import NativePoolAttention
from minigpt.model.backends import store_kv


def kernel_or_skip() -> None:
    if not pool_attention.NEEDS <= (cpu_class.usable_flags() or frozenset()):
        pytest.skip("the kernel is AVX2 + FMA + F16C code; this CPU lacks one of them")
    if not pool_attention.loaded():
        pytest.skip("the kernel's library did not build here (no C++ compiler?)")


def step(
    batch: int,
    lengths: list[int],
    dtype: torch.dtype,
    heads: int = 4,
    dim: int = 16,
    block_size: int = 4,
    blocks: int = 64,
    seed: int = 0,
):
    """A layer's pool [1, 2, blocks, block_size, H, D], shuffled block tables padded with block 0 (each sequence's
    blocks for its cached tokens and its new one), q/k/v [B, H, D]."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(1, 2, blocks, block_size, heads, dim, generator=generator).to(dtype)
    width = max(length // block_size + 1 for length in lengths)
    order = torch.randperm(blocks - 1, generator=generator) + 1
    tables = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for row, length in enumerate(lengths):
        count = length // block_size + 1
        tables[row, :count] = order[used : used + count]
        used += count
    context_lens = torch.tensor(lengths, dtype=torch.int32) + 1  # each sequence's own token counted
    q, k, v = (torch.randn(batch, heads, dim, generator=generator) for _ in range(3))
    scales = torch.tensor([dim**-0.5])
    return pool, tables, context_lens, scales, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[0], [1], [3, 4, 5, 8], [17, 0, 31, 9, 16], [100, 33, 0, 65]])
def test_the_kernel_is_pool_attention_to_fp32_rounding(dtype, lengths):
    kernel_or_skip()
    pool, tables, context_lens, scales, q, k, v = step(len(lengths), lengths, dtype)
    expected = PoolAttention(pool, tables, context_lens, scales)(0, q, k, v)
    got = NativePoolAttention(pool, tables, context_lens, scales)(0, q, k, v)
    assert got.shape == expected.shape == (len(lengths), 4 * 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [8, 64, 128])
def test_head_sizes_of_any_multiple_of_8(dim):
    kernel_or_skip()
    pool, tables, context_lens, scales, q, k, v = step(
        3, [40, 7, 64], torch.float16, heads=12, dim=dim, block_size=16, blocks=16
    )
    expected = PoolAttention(pool, tables, context_lens, scales)(0, q, k, v)
    torch.testing.assert_close(
        NativePoolAttention(pool, tables, context_lens, scales)(0, q, k, v), expected, rtol=1e-5, atol=1e-5
    )


def test_a_sequence_s_bits_alone_in_any_batch_and_on_any_threads():
    kernel_or_skip()
    lengths = [33, 5, 60, 0, 12, 47, 21, 8]
    pool, tables, context_lens, scales, q, k, v = step(len(lengths), lengths, torch.float16, heads=12, dim=64)
    batched = NativePoolAttention(pool, tables, context_lens, scales)(0, q, k, v)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(NativePoolAttention(pool, tables, context_lens, scales)(0, q, k, v), batched)
    finally:
        torch.set_num_threads(threads)
    for row in range(len(lengths)):
        rows = slice(row, row + 1)
        alone = NativePoolAttention(pool, tables[rows, : lengths[row] // 4 + 1], context_lens[rows], scales)(
            0, q[rows], k[rows], v[rows]
        )
        assert torch.equal(alone, batched[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_stores_the_new_k_v_in_their_slots_and_writes_nothing_else(dtype):
    """As `store_kv`, the engine's store (`Tensor.to` the pool's dtype), at each position `context_lens - 1`."""
    kernel_or_skip()
    lengths = [0, 3, 4, 17]  # the new token first in a block, in one, last in one, and past a full block
    pool, tables, context_lens, scales, q, k, v = step(len(lengths), lengths, dtype)
    expected = pool.clone()
    positions = context_lens.long() - 1
    slots = tables.long().gather(1, (positions // 4)[:, None]).squeeze(1) * 4 + positions % 4
    store_kv(k, v, expected[0, 0], expected[0, 1], slots)  # the engine's own store
    NativePoolAttention(pool, tables, context_lens, scales)(0, q, k, v)
    assert torch.equal(pool, expected)


def test_the_kernel_refuses_what_it_cannot_read():
    kernel_or_skip()
    pool, tables, context_lens, scales, q, k, v = step(2, [5, 6], torch.float32)
    layer, cached, before = pool[0], context_lens - 1, pool.clone()
    with pytest.raises(RuntimeError, match="D a multiple of 8"):
        pool_attention.decode(q[..., :12], k[..., :12], v[..., :12], layer[..., :12].contiguous(), tables, cached)
    with pytest.raises(RuntimeError, match="contiguous keys and values"):
        pool_attention.decode(q, k, v, layer.transpose(1, 2), tables, cached)
    with pytest.raises(RuntimeError, match="int32"):
        pool_attention.decode(q, k, v, layer, tables.long(), cached)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        pool_attention.decode(q, k, v, layer.double(), tables, cached)
    with pytest.raises(RuntimeError, match="k and v must be float32"):
        pool_attention.decode(q, k.half(), v, layer, tables, cached)
    with pytest.raises(RuntimeError, match="block 64 is not in the pool of 64"):
        pool_attention.decode(q, k, v, layer, torch.tensor([[1, 2], [3, 64]], dtype=torch.int32), cached)
    with pytest.raises(RuntimeError, match="caches 8 tokens, its table holds 8 with its new one"):
        pool_attention.decode(q, k, v, layer, tables, torch.tensor([5, 8], dtype=torch.int32))
    assert torch.equal(pool, before)  # nothing refused was written


def test_where_the_kernel_is_usable(monkeypatch):
    kernel_or_skip()
    pool = torch.zeros(2, 2, 4, 16, 12, 64, dtype=torch.float16)
    assert pool_attention.usable(pool)
    assert not pool_attention.usable(pool[..., :12])  # a head of 12: not a multiple of 8
    assert not pool_attention.usable(pool.to("meta"))
    assert not pool_attention.usable(pool.double())
    monkeypatch.setenv(cpu_class.NATIVE_SWITCH, "0")
    assert not pool_attention.usable(pool)


def test_the_compiled_steps_take_the_kernel_where_usable_and_name_it_in_their_key(monkeypatch, tiny_checkpoint):
    """The decode programs are built from `native_decode_layer` where the kernel is usable, from `decode_layer`
    with the switch off; the cache entry's description names which (another entry, never the other's programs)."""
    kernel_or_skip()
    from minigpt import LLM
    from minigpt.compile import steps

    built = []

    def load(self, description, names, specs):
        built.append((description["decode_layer"], {spec.name: spec.module.call.fn for spec in specs()}))
        raise RuntimeError("stopped before building")

    monkeypatch.setattr(steps.ProgramCache, "load", load)
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_class.NATIVE_SWITCH, switch)
        with pytest.raises(RuntimeError, match="stopped before building"):
            LLM(str(tiny_checkpoint), compile=True)
    (on, on_programs), (off, off_programs) = built
    assert on == "native_decode_layer" and off == "decode_layer"
    assert on_programs["layer"] is on_programs["layer_alone"] is steps.native_decode_layer
    assert off_programs["layer"] is off_programs["layer_alone"] is steps.decode_layer
