"""Paged decode attention in Triton (reference: `reference.paged_decode_attention`): a program per (sequence,
head, context split), an fp32 online softmax, the splits merged by a second kernel. A split is SPLIT_TOKENS
whatever the batch, so a sequence sums in the same order alone, in any batch and in a CUDA graph."""

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 64  # context tokens per loop step (any block_size works: blocks are looked up per token)
SPLIT_TOKENS = 256  # a multiple of BLOCK_N; a shorter split costs more in merging than it wins
MAX_SPLITS = 32


@triton.jit
def _attend(
    q,
    k_head,
    v_head,
    table_row,
    start,
    end,
    stride_kb,
    stride_kt,
    mask_d,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """q [BLOCK_D] fp32, pre-scaled by log2(e) * scale, over tokens [start, end) -> (acc unnormalised,
    m running max in log2 units, l_sum running sum), fp32."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    m = tl.full([], float("-inf"), dtype=tl.float32)
    l_sum = tl.full([], 0.0, dtype=tl.float32)
    for first in range(start, end, BLOCK_N):
        tok = first + tl.arange(0, BLOCK_N)
        valid = tok < end
        block = tl.load(table_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_kb + (tok % BLOCK_SIZE) * stride_kt  # (BLOCK_N,)
        mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_head[None, :] + row[:, None], mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(v_head[None, :] + row[:, None], mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        m = m_new
    return acc, m, l_sum


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [B, H, D] query dtype, or [B, H, S, D] fp32 partial outputs when SPLIT
    m_ptr,  # [B, H, S] fp32 running max per split (SPLIT only)
    l_ptr,  # [B, H, S] fp32 running sum per split (SPLIT only)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    qk_scale,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_tb,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    num_splits = tl.num_programs(2)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + offs_d * stride_qd, mask=mask_d, other=0.0)
    q = q.to(tl.float32) * qk_scale

    context_len = tl.load(context_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)
    head_offs = head * stride_kh + offs_d * stride_kd
    acc, m, l_sum = _attend(
        q,
        k_cache_ptr + head_offs,
        v_cache_ptr + head_offs,
        block_tables_ptr + seq.to(tl.int64) * stride_tb,
        start,
        end,
        stride_kb,
        stride_kt,
        mask_d,
        BLOCK_SIZE,
        BLOCK_N,
        BLOCK_D,
    )
    row = (seq * num_heads + head) * num_splits + split  # flat index into [B, H, S]
    if SPLIT:
        tl.store(out_ptr + row.to(tl.int64) * head_dim + offs_d, acc, mask=mask_d)
        tl.store(m_ptr + row, m)
        tl.store(l_ptr + row, l_sum)
    else:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)  # an empty context gives zeros, not NaN
        tl.store(out_ptr + row.to(tl.int64) * head_dim + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [B, H, D] query dtype
    acc_ptr,  # [B, H, S, D] fp32
    m_ptr,  # [B, H, S] fp32
    l_ptr,  # [B, H, S] fp32
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)  # (seq, head)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < head_dim
    m = tl.load(m_ptr + row * num_splits + offs_s, mask=mask_s, other=float("-inf"))
    l_sum = tl.load(l_ptr + row * num_splits + offs_s, mask=mask_s, other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_max > float("-inf"), m_max, 0.0))  # empty splits weigh 0
    acc_offs = (row * num_splits + offs_s)[:, None] * head_dim + offs_d[None, :]
    acc = tl.load(acc_ptr + acc_offs, mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weight * l_sum, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * head_dim + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def default_split_tokens(max_context: int) -> int:
    """Context tokens per split: ``SPLIT_TOKENS``, or more where that would take over ``MAX_SPLITS``."""
    return max(SPLIT_TOKENS, triton.cdiv(triton.cdiv(max_context, MAX_SPLITS), BLOCK_N) * BLOCK_N)


def paged_decode_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    scale: float,
    num_splits: int | None = None,
) -> Tensor:
    """As `reference.paged_decode_attention`; num_splits None: splits of `default_split_tokens`."""
    batch, num_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        tokens_per_split = default_split_tokens(max_context)
    else:
        tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), BLOCK_N) * BLOCK_N
    num_splits = max(triton.cdiv(max_context, tokens_per_split), 1)

    out = torch.empty(batch, num_heads, head_dim, dtype=query.dtype, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        m = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
        l_sum = torch.empty_like(m)
    else:
        acc, m, l_sum = out, out, out  # m and l_sum are unused without splits
    _paged_decode_kernel[(batch, num_heads, num_splits)](
        acc,
        m,
        l_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel works with exp2
        tokens_per_split,
        *query.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        SPLIT=split,
    )
    if split:
        _merge_splits_kernel[(batch, num_heads)](
            out,
            acc,
            m,
            l_sum,
            num_splits,
            head_dim,
            # one width for any split count: the splits of a sequence merge in the same order however many follow
            BLOCK_S=triton.next_power_of_2(max(num_splits, MAX_SPLITS)),
            BLOCK_D=block_d,
        )
    return out
