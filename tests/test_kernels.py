"""Paged-KV kernels: the torch references against naive attention here; the Triton kernels in child processes.

This process never imports triton. ``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel
(triton's own helpers included), so the two Triton checks each need a process of their own:
- ``kernel_cases.py``: every kernel against its reference, under ``TRITON_INTERPRET=1`` without a GPU;
- ``kernel_compile_check.py``: every kernel compiled to sm_80 and sm_90, with ``TRITON_INTERPRET`` unset.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kernel_inputs import DEVICE, DTYPES, TOL, decode_args, fused_kv_rows, make_pool

from minigpt.common.torch_support import release
from minigpt.compile.attention import PROMPT_PIECE, causal_mask, prompt_attention
from minigpt.kernels import reference
from minigpt.model.attention import token_attention
from minigpt.model.backends import TorchBackend

HERE = Path(__file__).parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def naive_decode_attention(p: SimpleNamespace) -> torch.Tensor:
    """Dense softmax attention per sequence in float64, reading tokens one by one: [B, H, D]."""
    block_size = p.k_cache.shape[1]
    outs = []
    for b, n in enumerate(p.context_lens.tolist()):
        slots = [(p.block_tables[b, t // block_size].item(), t % block_size) for t in range(n)]
        keys = torch.stack([p.k_cache[blk, off] for blk, off in slots]).double()  # (n, H, D)
        values = torch.stack([p.v_cache[blk, off] for blk, off in slots]).double()
        scores = torch.einsum("hd,nhd->hn", p.query[b].double(), keys) * p.scale
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reference_decode_matches_naive_attention(dtype: torch.dtype, block_size: int) -> None:
    p = make_pool([1, block_size, 2 * block_size, 37, 70], block_size, num_heads=3, head_dim=64, dtype=dtype)
    out = reference.paged_decode_attention(*decode_args(p))
    assert out.dtype == dtype and out.shape == p.query.shape
    torch.testing.assert_close(out.double(), naive_decode_attention(p), **TOL[dtype])


def test_reference_decode_empty_context_gives_zeros() -> None:
    p = make_pool([0, 5], 16, num_heads=2, head_dim=64, dtype=torch.float32)
    out = reference.paged_decode_attention(*decode_args(p))
    assert (out[0] == 0).all() and out.isfinite().all()


def test_reference_decode_fp16_softmax_runs_in_fp32() -> None:
    """Scores far past fp16's range (65504) still give the right, finite attention."""
    p = make_pool([20, 9], 8, num_heads=2, head_dim=64, dtype=torch.float16)
    p.k_cache *= 100.0
    p.query *= 100.0
    p.scale = 1.0
    out = reference.paged_decode_attention(*decode_args(p))
    torch.testing.assert_close(out.double(), naive_decode_attention(p), **TOL[torch.float16])


def naive_token_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """Masked softmax attention over flat tokens in float64: [T, H, D]."""
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v.double())


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("length", "cached"), [(1, 0), (9, 0), (40, 0), (7, 16)])
def test_token_attention_is_causal_attention(compiled: bool, length: int, cached: int) -> None:
    """Both forms (eager: the flash kernel's 4-D inputs; compiled: the 3-D math path) compute causal
    attention over a chunk, with and without a cached prefix before it."""
    torch.manual_seed(0)
    context = cached + length
    q = torch.randn(length, 3, 64)
    k, v = torch.randn(context, 3, 64), torch.randn(context, 3, 64)
    mask = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None]  # (T, context)
    attention = torch.compile(token_attention, fullgraph=True) if compiled else token_attention
    if cached:
        out = attention(q, k, v, 0.125, mask=mask)
    else:
        out = attention(q, k, v, 0.125)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), naive_token_attention(q, k, v, 0.125, mask), rtol=1e-5, atol=1e-5)


def paged_prompt(length: int, block_size: int, pool: torch.dtype):
    """q [length, H, D] and its K/V stored in shuffled blocks of a `pool` pool; slots no prompt
    position holds are NaN (a stale block may hold anything)."""
    torch.manual_seed(0)
    heads, dim, blocks = 3, 64, -(-length // block_size) + 2
    q, k, v = (torch.randn(length, heads, dim) for _ in range(3))
    table = torch.randperm(blocks)[: -(-length // block_size)]
    caches = [torch.full((blocks, block_size, heads, dim), float("nan"), dtype=pool) for _ in range(2)]
    slots = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
    reference.store_kv(k, v, *caches, slots)
    return q, caches, table


@pytest.mark.parametrize(("block_size", "pool"), [(16, torch.float32), (8, torch.float16)])
def test_prompt_attention_is_causal_attention_and_the_same_bits_however_chunked(block_size, pool) -> None:
    """A prompt's rows through `prompt_attention`, in one chunk or in chunks of any size (its earlier
    positions then read back from the blocks): causal attention over the blocks as stored, each row the
    same bits in every chunking (the flash kernel's own blocks follow the keys it is given), NaN slots
    past the prompt never read."""
    length = 300
    q, (k_cache, v_cache), table = paged_prompt(length, block_size, pool)
    causal = causal_mask(-(-length // PROMPT_PIECE) * PROMPT_PIECE, q.dtype, q.device)
    whole = prompt_attention(q, k_cache, v_cache, table, 0, 0.125, causal)
    stored = [cache[table].flatten(0, 1)[:length].float() for cache in (k_cache, v_cache)]
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    torch.testing.assert_close(whole.double(), naive_token_attention(q, *stored, 0.125, mask), rtol=1e-5, atol=1e-5)
    for chunk in (1, 7, PROMPT_PIECE, 33, 100):
        parts = [prompt_attention(q[start : start + chunk], k_cache, v_cache, table, start, 0.125, causal)
                 for start in range(0, length, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk


@pytest.mark.parametrize("masked", [False, True])
def test_token_attention_takes_the_cpu_flash_kernel(masked: bool) -> None:
    """Eager prompts must reach torch's flash kernel (3-D inputs fall back to its 2.5-3.5x slower math
    path); compiled, the math form stays, which inductor fuses around its matrix products."""
    q = k = v = torch.randn(12, 3, 64)
    mask = torch.ones(12, 12, dtype=torch.bool).tril() if masked else None
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"
    compiled = torch.compile(token_attention, fullgraph=True)
    compiled(q, k, v, 0.125, mask=mask)
    # torch 2.14's inductor lowers the compiled form to the flash kernel too
    cases = ((token_attention, True),) + (((compiled, False),) if release(torch.__version__) == (2, 13) else ())
    for attention, reaches_flash in cases:
        with torch.profiler.profile() as prof:
            attention(q, k, v, 0.125, mask=mask)
        events = {event.name for event in prof.events()}
        assert (flash in events) == reaches_flash
        assert reaches_flash or "aten::bmm" in events


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_reuses_one_gather_buffer(dtype: torch.dtype) -> None:
    """The engine's CPU backend gathers blocks into a buffer it keeps: results equal the reference's fresh
    gathers whether the buffer is new, left over (larger, stale) from a bigger step, or regrown."""
    backend = TorchBackend()
    big = make_pool([70, 37, 16, 5], 16, num_heads=3, head_dim=64, dtype=dtype, seed=1)
    small = make_pool([9, 30], 16, num_heads=3, head_dim=64, dtype=dtype, seed=2)
    bigger = make_pool([130, 1, 64, 33, 17, 90], 16, num_heads=3, head_dim=64, dtype=dtype, seed=3)
    buffers = []
    for p in (big, small, bigger):
        out = backend.decode(*decode_args(p))
        assert torch.equal(out, reference.paged_decode_attention(*decode_args(p)))
        buffers.append(backend.workspace)
    assert buffers[1] is buffers[0], "a smaller step must reuse the buffer"
    assert buffers[2].numel() == 2 * bigger.block_tables.numel() * bigger.k_cache[0].numel()


@pytest.mark.parametrize("pool", [torch.float16, torch.bfloat16])
def test_torch_backend_converts_half_blocks_into_a_kept_buffer(pool: torch.dtype) -> None:
    """A half-precision pool under a float32 query (kv_cache_dtype): the blocks are converted into a second
    kept buffer, with the results of converting fresh copies."""
    backend = TorchBackend()
    big = make_pool([70, 37, 16, 5], 16, num_heads=3, head_dim=64, dtype=pool, seed=1)
    small = make_pool([9, 30], 16, num_heads=3, head_dim=64, dtype=pool, seed=2)
    buffers = []
    for p in (big, small):
        p.query = p.query.float()
        out = backend.decode(*decode_args(p))
        assert out.dtype == torch.float32
        assert torch.equal(out, reference.paged_decode_attention(*decode_args(p)))
        buffers.append(backend.converted)
    assert buffers[0].dtype == torch.float32 and buffers[1] is buffers[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_store_kv_writes_slots_and_skips_padding(dtype: torch.dtype) -> None:
    block_size, num_heads, head_dim = 8, 3, 16
    k_cache = torch.zeros(6, block_size, num_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, -1, 0, 47, -1, 9], device=DEVICE)
    key, value = fused_kv_rows(len(slots), num_heads, head_dim, dtype)
    reference.store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, num_heads, head_dim), v_cache.view(-1, num_heads, head_dim)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[row]) and torch.equal(flat_v[slot], value[row])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()


def run_child(args: list[str], env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, *args], cwd=HERE.parent, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]


@pytest.mark.triton
@needs_triton
def test_triton_kernels_match_references() -> None:
    """``kernel_cases.py`` in a fresh process (it sets TRITON_INTERPRET=1 itself when there is no GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run_child(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "kernel_cases.py")], env)


@pytest.mark.triton
@needs_triton
def test_triton_kernels_compile_for_sm80_and_sm90() -> None:
    """Real compilation catches what the interpreter lets through (e.g. a loop-carried dtype change)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run_child([str(HERE / "kernel_compile_check.py")], env)
