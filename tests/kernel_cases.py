"""The Triton kernels against their torch references; run by ``test_kernels.py`` in a child process.

Without a GPU, triton must be imported with ``TRITON_INTERPRET=1`` already set: it is read when
``@triton.jit`` decorates each kernel, triton's own helpers included. So this module sets it before
importing triton and only runs in a process of its own (pytest does not collect it: no ``test_`` prefix).
Run directly with ``python -m pytest -q tests/kernel_cases.py``.
"""


import pytest
import torch
from kernel_inputs import DEVICE, DTYPES, TOL, decode_args, fused_kv_rows, import_triton_for_tests, make_pages

import_triton_for_tests()

from minigpt.kernels import kv_store, paged_attention, reference  # noqa: E402

pytestmark = pytest.mark.triton


def check_decode(p, num_splits: int | None = None) -> None:
    out = paged_attention.paged_decode_attention(*decode_args(p), num_splits=num_splits)
    assert out.dtype == p.query.dtype and out.shape == p.query.shape
    torch.testing.assert_close(out, reference.paged_decode_attention(*decode_args(p)), **TOL[p.query.dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode(dtype: torch.dtype, block_size: int, num_splits: int) -> None:
    lens = [1, block_size, 2 * block_size + 3, 150]  # one token, a whole page, ragged, long enough for 3 splits
    check_decode(make_pages(lens, block_size, num_heads=2, head_dim=64, dtype=dtype), num_splits)


@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_batch_sizes(batch: int, num_splits: int) -> None:
    lens = torch.randint(1, 130, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    check_decode(make_pages(lens, 16, num_heads=3, head_dim=64, dtype=torch.float32, seed=batch), num_splits)


@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_paged_decode_head_dims(head_dim: int) -> None:
    check_decode(make_pages([5, 40], 16, num_heads=3, head_dim=head_dim, dtype=torch.float16))


def test_paged_decode_steps_shorter_than_a_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens per loop step need not be a multiple of the page size, nor splits page-aligned."""
    monkeypatch.setattr(paged_attention, "BLOCK_N", 16)
    p = make_pages([1, 32, 33, 90], 32, num_heads=2, head_dim=64, dtype=torch.bfloat16)
    for num_splits in (1, 4):
        check_decode(p, num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_strided_query_and_empty_context(num_splits: int) -> None:
    p = make_pages([0, 100, 7], 16, num_heads=2, head_dim=64, dtype=torch.float32)
    p.query = torch.randn(3, 3, 2, 64, device=DEVICE)[:, 0]  # strided like a slice of a fused qkv
    check_decode(p, num_splits)
    assert (paged_attention.paged_decode_attention(*decode_args(p), num_splits=num_splits)[0] == 0).all()


def test_paged_decode_default_splits() -> None:
    tokens = paged_attention.default_split_tokens
    assert tokens(max_context=100) == tokens(max_context=1024) == paged_attention.SPLIT_TOKENS  # GPT-2's contexts
    assert tokens(max_context=64 * paged_attention.SPLIT_TOKENS) == 2 * paged_attention.SPLIT_TOKENS  # 32 splits
    check_decode(make_pages([600], 16, num_heads=1, head_dim=64, dtype=torch.float16))  # takes 3 splits


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_of_a_sequence_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each sequence alone, over just its pages, gives bitwise the output it gets in a batch whose tables
    are wider (as a CUDA graph's padded step reads them): one split or several, summed in the same order."""
    lens = [5, 300, 600, 40]
    p = make_pages(lens, 16, num_heads=2, head_dim=64, dtype=dtype)
    batched = paged_attention.paged_decode_attention(*decode_args(p))
    for b, n in enumerate(lens):
        pages = -(-n // 16)
        alone = paged_attention.paged_decode_attention(
            p.query[b : b + 1], p.k_cache, p.v_cache, p.block_tables[b : b + 1, :pages].contiguous(),
            p.context_lens[b : b + 1], p.scale,
        )
        assert torch.equal(alone[0], batched[b]), n


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype: torch.dtype, block_size: int) -> None:
    num_heads, head_dim, num_blocks = 3, 64, 5
    gen = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    slots[[1, 4]] = -1  # padding rows
    slots = slots.to(DEVICE)
    key, value = fused_kv_rows(len(slots), num_heads, head_dim, dtype, seed=block_size)
    caches = torch.randn(2, num_blocks, block_size, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    expected = caches.clone()
    reference.store_kv(key, value, expected[0], expected[1], slots)
    kv_store.store_kv(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches, expected)
