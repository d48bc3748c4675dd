"""The Triton kernels against their torch references; run by ``test_kernels.py`` in a child process.

Without a GPU, triton must be imported with ``TRITON_INTERPRET=1`` already set: it is read when
``@triton.jit`` decorates each kernel, triton's own helpers included. So this module sets it before
importing triton and only runs in a process of its own (pytest does not collect it: no ``test_`` prefix).
Run directly with ``python -m pytest -q tests/kernel_cases.py``.
"""


import pytest
import torch
from kernel_inputs import DEVICE, DTYPES, TOL, decode_args, fused_kv_rows, import_triton_for_tests, make_pool

import_triton_for_tests()

from minigpt.kernels import fused_block, kv_store, paged_attention, reference  # noqa: E402
from minigpt.model.activations import ACTIVATIONS  # noqa: E402
from minigpt.model.attention import CausalAttention  # noqa: E402
from minigpt.model.config import GPT2Config  # noqa: E402
from minigpt.model.gpt2 import GPT2  # noqa: E402

pytestmark = pytest.mark.triton


def check_decode(p, num_splits: int | None = None) -> None:
    out = paged_attention.paged_decode_attention(*decode_args(p), num_splits=num_splits)
    assert out.dtype == p.query.dtype and out.shape == p.query.shape
    torch.testing.assert_close(out, reference.paged_decode_attention(*decode_args(p)), **TOL[p.query.dtype])


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode(dtype: torch.dtype, block_size: int, num_splits: int) -> None:
    lens = [1, block_size, 2 * block_size + 3, 150]  # one token, a whole block, ragged, long enough for 3 splits
    check_decode(make_pool(lens, block_size, num_heads=2, head_dim=64, dtype=dtype), num_splits)


@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_batch_sizes(batch: int, num_splits: int) -> None:
    lens = torch.randint(1, 130, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    check_decode(make_pool(lens, 16, num_heads=3, head_dim=64, dtype=torch.float32, seed=batch), num_splits)


@pytest.mark.parametrize("head_dim", [32, 80, 128])
def test_paged_decode_head_dims(head_dim: int) -> None:
    check_decode(make_pool([5, 40], 16, num_heads=3, head_dim=head_dim, dtype=torch.float16))


def test_paged_decode_steps_shorter_than_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens per loop step need not be a multiple of the block size, nor splits block-aligned."""
    monkeypatch.setattr(paged_attention, "BLOCK_N", 16)
    p = make_pool([1, 32, 33, 90], 32, num_heads=2, head_dim=64, dtype=torch.bfloat16)
    for num_splits in (1, 4):
        check_decode(p, num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_decode_strided_query_and_empty_context(num_splits: int) -> None:
    p = make_pool([0, 100, 7], 16, num_heads=2, head_dim=64, dtype=torch.float32)
    p.query = torch.randn(3, 3, 2, 64, device=DEVICE)[:, 0]  # strided like a slice of a fused qkv
    check_decode(p, num_splits)
    assert (paged_attention.paged_decode_attention(*decode_args(p), num_splits=num_splits)[0] == 0).all()


def test_paged_decode_default_splits() -> None:
    tokens = paged_attention.default_split_tokens
    assert tokens(max_context=100) == tokens(max_context=1024) == paged_attention.SPLIT_TOKENS  # GPT-2's contexts
    assert tokens(max_context=64 * paged_attention.SPLIT_TOKENS) == 2 * paged_attention.SPLIT_TOKENS  # 32 splits
    check_decode(make_pool([600], 16, num_heads=1, head_dim=64, dtype=torch.float16))  # takes 3 splits


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_of_a_sequence_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each sequence alone, over just its blocks, gives bitwise the output it gets in a batch whose tables
    are wider (as a CUDA graph's padded step reads them): one split or several, summed in the same order."""
    lens = [5, 300, 600, 40]
    p = make_pool(lens, 16, num_heads=2, head_dim=64, dtype=dtype)
    batched = paged_attention.paged_decode_attention(*decode_args(p))
    for b, n in enumerate(lens):
        blocks = -(-n // 16)
        alone = paged_attention.paged_decode_attention(
            p.query[b : b + 1], p.k_cache, p.v_cache, p.block_tables[b : b + 1, :blocks].contiguous(),
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


EMBEDS = [48, 768, 1600]  # n_embd: not a power of two (as GPT-2's), distilgpt2 / gpt2, gpt2-xl


def residual_rows(rows: int, n_embd: int, dtype: torch.dtype, seed: int = 0):
    """A residual stream x [rows, C] fp32 (a row of a wider tensor: strided), an update of `dtype`, and
    layernorm weight and bias in fp32, as the model keeps them."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, n_embd + 5, generator=gen) + 1)[:, :n_embd]
    delta = torch.randn(rows, n_embd, generator=gen).to(dtype)
    weight, bias = 1 + torch.randn(2, n_embd, generator=gen) * 0.5
    return x.to(DEVICE), delta.to(DEVICE), weight.to(DEVICE), (bias - 1).to(DEVICE)


@pytest.mark.parametrize("n_embd", EMBEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layernorm(dtype: torch.dtype, n_embd: int) -> None:
    """The sum exactly the reference's (one fp32 add); the norm, computed in fp32, within a rounding to `dtype`."""
    x, delta, weight, bias = residual_rows(7, n_embd, dtype)
    total, normed = fused_block.add_layernorm(x, delta, weight, bias, 1e-5, dtype)
    want_total, want = reference.add_layernorm(x, delta, weight, bias, 1e-5, dtype)
    assert total.dtype == torch.float32 and normed.dtype == dtype and normed.shape == x.shape
    assert torch.equal(total, want_total)
    torch.testing.assert_close(normed, want, **TOL[dtype])
    alone = fused_block.layernorm(x, weight, bias, 1e-5, dtype)
    torch.testing.assert_close(alone, reference.layernorm(x, weight, bias, 1e-5, dtype), **TOL[dtype])
    if dtype == torch.float32:  # the model's own layernorm
        ln = torch.nn.LayerNorm(n_embd, eps=1e-5).to(DEVICE)
        ln.weight.data.copy_(weight)
        ln.bias.data.copy_(bias)
        torch.testing.assert_close(alone, ln(x), **TOL[dtype])


def test_add_layernorm_rows_of_any_batch_shape_and_none() -> None:
    x, delta, weight, bias = residual_rows(6, 48, torch.float16)
    total, normed = fused_block.add_layernorm(x.reshape(2, 3, 48), delta.view(2, 3, 48), weight, bias, 1e-5,
                                              torch.float16)
    assert total.shape == normed.shape == (2, 3, 48)
    assert torch.equal(normed.view(6, 48), fused_block.add_layernorm(x, delta, weight, bias, 1e-5, torch.float16)[1])
    empty = fused_block.add_layernorm(x[:0], delta[:0], weight, bias, 1e-5, torch.float16)
    assert empty[0].shape == empty[1].shape == (0, 48)
    with pytest.raises(ValueError, match="delta shape"):
        fused_block.add_layernorm(x, delta[:3], weight, bias, 1e-5, torch.float16)


@pytest.mark.parametrize("n_embd", EMBEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(dtype: torch.dtype, n_embd: int) -> None:
    """c_fc's output [N, 4C] plus its bias through gelu_new, against the reference and the model's activation."""
    gen = torch.Generator().manual_seed(n_embd)
    h = (3 * torch.randn(5, 4 * n_embd, generator=gen)).to(dtype).to(DEVICE)
    bias = torch.randn(4 * n_embd, generator=gen).to(dtype).to(DEVICE)
    out = fused_block.bias_gelu(h, bias)
    assert out.dtype == dtype and out.shape == h.shape
    torch.testing.assert_close(out, reference.bias_gelu(h, bias), **TOL[dtype])
    model_gelu = ACTIVATIONS["gelu_new"](h.float() + bias.float())
    torch.testing.assert_close(out.float(), model_gelu, **TOL[dtype])
    assert fused_block.bias_gelu(h[:0], bias).shape == (0, 4 * n_embd)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_through_the_fused_kernels_give_the_plain_forward(dtype: torch.dtype) -> None:
    """`Block.forward` with an attention whose `fused` are the kernels: the plain forward's logits, within
    rounding (fp32), within a few roundings of `dtype` (half)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=4)
    model = GPT2(config, dtype).eval()
    for param in model.parameters():
        param.data.normal_(0.0, 0.3)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):  # the layernorms stay fp32, as loading keeps them
            module.to(dtype)
    model = model.to(DEVICE)
    ids = torch.randint(97, (2, 9), device=DEVICE)
    positions = torch.arange(9, device=DEVICE).expand(2, 9).flatten()
    with torch.no_grad():
        plain = model(ids).view(18, -1).float()
        attention = CausalAttention(2, None, model.attention_scales(), False)
        attention.fused = fused_block
        fused = model.run(ids.flatten(), positions, attention).float()
        rows = torch.tensor([3, 17], device=DEVICE)
        last = model.run(ids.flatten(), positions, attention, rows).float()
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(fused, plain, **tol)
    torch.testing.assert_close(last, fused[rows], **tol)
