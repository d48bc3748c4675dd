"""A block's elementwise steps in Triton (references: `reference.add_layernorm`, `reference.bias_gelu`): the
residual add and the layernorm after it in one pass over a row, the normalized row cast to the linears' dtype; the
c_fc bias and GPT-2's tanh GELU in one pass. fp32 math whatever the inputs' dtype; a row's programs never depend on
its batch, so its bits do not either."""

import torch
import triton
import triton.language as tl
from torch import Tensor

GELU_BLOCK = 1024  # columns per bias + GELU program


@triton.jit
def _add_layernorm_kernel(
    x_ptr,  # [N, C] the residual stream
    delta_ptr,  # [N, C] added to it (HAS_DELTA only)
    sum_ptr,  # [N, C] x + delta, of x's dtype (HAS_DELTA only)
    out_ptr,  # [N, C] layernorm(x + delta), of the linears' dtype
    weight_ptr,
    bias_ptr,
    n_cols,
    stride_x,
    stride_delta,
    stride_sum,
    stride_out,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(sum_ptr + row * stride_sum + cols, x.to(sum_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(x, axis=0) / n_cols
    centred = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = centred * rstd * weight + bias
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_kernel(h_ptr, bias_ptr, out_ptr, n_cols, stride_h, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    h += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2 / pi) (h + 0.044715 h^3)
    out = h * tl.sigmoid(2.0 * inner)  # 0.5 h (1 + tanh(inner)), the same function
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: Tensor) -> Tensor:
    """(..., C) -> (N, C) with unit column stride."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_layernorm(x: Tensor, delta: Tensor | None, weight: Tensor, bias: Tensor, eps: float,
                      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows = _rows(x)
    n, cols = rows.shape
    total = torch.empty_like(rows) if delta is not None else rows
    out = torch.empty(n, cols, dtype=dtype, device=x.device)
    if n:
        block = triton.next_power_of_2(cols)
        added = rows if delta is None else _rows(delta)
        _add_layernorm_kernel[(n,)](
            rows, added, total, out, weight, bias, cols, rows.stride(0), added.stride(0), total.stride(0),
            out.stride(0), eps, HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 8),
        )
    return total.view(x.shape), out.view(*x.shape[:-1], cols)


def add_layernorm(x: Tensor, delta: Tensor, weight: Tensor, bias: Tensor, eps: float,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """As `reference.add_layernorm`: (x + delta in x's dtype, its layernorm over the last dim in `dtype`)."""
    if delta.shape != x.shape:
        raise ValueError(f"delta shape {tuple(delta.shape)} != x shape {tuple(x.shape)}")
    return _launch_layernorm(x, delta, weight, bias, eps, dtype)


def layernorm(x: Tensor, weight: Tensor, bias: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """As `reference.layernorm`: x's layernorm over the last dim in `dtype`."""
    return _launch_layernorm(x, None, weight, bias, eps, dtype)[1]


def bias_gelu(h: Tensor, bias: Tensor) -> Tensor:
    """As `reference.bias_gelu`: gelu_new(h + bias) in h's dtype."""
    rows = _rows(h)
    n, cols = rows.shape
    out = torch.empty_like(rows)
    if n:
        _bias_gelu_kernel[(n, triton.cdiv(cols, GELU_BLOCK))](
            rows, bias, out, cols, rows.stride(0), out.stride(0), BLOCK=GELU_BLOCK, num_warps=4,
        )
    return out.view(h.shape)
