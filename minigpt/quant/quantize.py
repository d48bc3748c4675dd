"""int8 linears replacing every nn.Linear: `int8` (weight-only, per-channel absmax / 127, gpt-fast's recipe) and
`w8a8` (each activation row also rounded to int8 with its own scale: exact integer products, per row so a request
does not depend on its batch), through `torch._int_mm`, or on AVX2-only CPUs fbgemm (`fbgemm_int8`); a few rows
through a kernel of our own on any CPU with AVX2 (`int8_rows`)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from minigpt.engine.config import QUANTIZATIONS
from minigpt.model.linears import replace_linears
from minigpt.quant import fbgemm_int8, int8_rows

EXACT_TERMS = 1040  # int8 x int8 products (<= 127 * 127) an fp32 sum of which is exact: below 2**24
ONE_ROW_MAX_INPUTS = 4096  # inputs up to which a compiled program of one row takes `one_row_products`


class Int8Linear(nn.Module):
    """A frozen nn.Linear: int8 weight, one scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight, scales = round_to_int8(linear.weight.detach().float())
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        # the CPU kernel takes half activations and scales of their dtype
        self.register_buffer("half_scales", scales.to(_half_dtype(linear.weight.dtype)))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu" and self.in_features % 8 == 0:
            # vectorized for half activations only; inputs read 8 at a time (other sizes: wrong products)
            half = flat.to(self.half_scales.dtype)
            out = torch.ops.aten._weight_int8pack_mm(half, self.weight, self.half_scales).to(flat.dtype)
        else:
            out = F.linear(flat, self.weight.to(flat.dtype)) * self.scales.to(flat.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class W8A8Linear(Int8Linear):
    """int8 weights and per-row int8 activations ([-63, 63] through fbgemm, exact only for 7 bits)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.fbgemm = fbgemm_int8.available(self.weight.device)
        self.levels = fbgemm_int8.ACTIVATION_LEVELS if self.fbgemm else 127
        # not where fbgemm runs: inductor's AVX2 code loads int8 through a scalar copy (scripts/PERFORMANCE.md)
        self.reduce_one_row = (self.weight.device.type == "cpu" and self.in_features <= ONE_ROW_MAX_INPUTS
                               and not self.fbgemm)
        if self.fbgemm:
            fbgemm_int8.pack(self.weight)
            self.fixed_addresses = ("weight",)  # its address keys fbgemm's packing: `huge_pages` leaves it in place
        # a second copy of the weight, in the kernel's packing: a row is read faster from it at every class
        few_rows = self.weight.device.type == "cpu" and int8_rows.usable(self.in_features)
        self.register_buffer("packed", int8_rows.pack(self.weight) if few_rows else None, persistent=False)

    @property
    def few_rows(self) -> bool:
        """A few rows go through the AVX2 kernel (`int8_rows`), over this packing of the weight."""
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        row_scales = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / self.levels
        quantized = torch.round(flat / row_scales)
        if self.few_rows and statically_known_true(flat.shape[0] <= int8_rows.ROWS):
            # a program of one sequence calls the kernel's own op (no Python between); any other batch, fbgemm's op
            products = int8_rows.rows_mm(quantized.to(torch.int8), self.packed, self.out_features)
        elif self.fbgemm:
            products = fbgemm_int8.int8_mm(quantized, self.weight, self.packed)
        elif self.few_rows:
            products = int8_rows.rows_or_int_mm(quantized.to(torch.int8), self.weight, self.packed).float()
        elif self.reduce_one_row and torch.compiler.is_compiling() and statically_known_true(flat.shape[0] == 1):
            products = one_row_products(quantized, self.weight)
        else:
            # the transposed view: the column-major operand torch's int8 matmul reads fastest
            products = torch._int_mm(quantized.to(torch.int8), self.weight.t()).float()
        out = products.mul_(row_scales).mul_(self.scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def one_row_products(row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """row [1, K] of int8 values as floats, weight [N, K] int8 -> `torch._int_mm(row, weight.t()).float()`: a
    reduction the compiler fuses with the weight's conversion, exact in fp32 over short pieces, then int32."""
    n, k = weight.shape
    row = row.as_strided(row.shape, row.stride())  # stored once: else the compiler rounds the row per output
    piece = max(size for size in range(1, EXACT_TERMS + 1) if k % size == 0)
    pieces = (row.view(1, k // piece, piece) * weight.view(n, k // piece, piece).float()).sum(-1)
    return pieces.to(torch.int32).sum(-1).float()[None]


def round_to_int8(weight: torch.Tensor, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8, fp32 scales [out]), `rows` at a time (a whole quotient would page-fault)."""
    low, high = torch.aminmax(weight, dim=1)
    scales = torch.maximum(high, -low).clamp(min=1e-12) / 127.0
    rounded = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    quotient = weight.new_empty(min(rows, weight.shape[0]), weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        chunk = quotient[: min(rows, weight.shape[0] - start)]
        torch.div(weight[start : start + rows], scales[start : start + rows, None], out=chunk)
        rounded[start : start + rows].copy_(chunk.round_().clamp_(-127, 127))
    return rounded, scales


def _half_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {QUANTIZATIONS}, got {mode!r}")
    return replace_linears(model, Int8Linear if mode == "int8" else W8A8Linear)
