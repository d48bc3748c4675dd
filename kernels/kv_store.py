"""A step's new K/V rows into their cache slots in Triton, a program per row (reference: `reference.store_kv`)."""

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_xn,
    stride_xh,
    stride_xd,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    num_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < head_dim)[None, :] & (slot >= 0)
    src = row.to(tl.int64) * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :] * stride_xd
    slot = tl.maximum(slot, 0)
    dst = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_ct
        + offs_h[:, None] * stride_ch
        + offs_d[None, :] * stride_cd
    )
    key = tl.load(key_ptr + src, mask=mask)
    value = tl.load(value_ptr + src, mask=mask)
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """As `reference.store_kv`; key and value, k_cache and v_cache of the same strides."""
    num_rows, num_heads, head_dim = key.shape
    if key.shape != value.shape or key.stride() != value.stride():
        raise ValueError("key and value must have the same shape and strides")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if num_rows == 0:
        return
    _store_kv_kernel[(num_rows,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *k_cache.stride(),
        num_heads,
        head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
