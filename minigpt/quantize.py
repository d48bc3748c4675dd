"""int8 linears, two ways; every nn.Linear of the model (attention, MLP, LM head) is replaced.

- `int8` (weight-only): weights rounded per output channel (absmax / 127), activations untouched:
  `x @ W_int8^T * scale + bias`, gpt-fast's recipe. A quarter of fp32's weight bytes.
- `w8a8`: the same int8 weights, and each activation row quantized to int8 on the fly with its own
  scale, so the product runs as an int8 x int8 matrix multiply (VNNI on x86 CPUs). Per-row (per
  token) scales keep a request's result independent of what else is in the batch. Faster than
  weight-only on the CPU at every batch size measured, at some accuracy cost (see tests).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt import fbgemm_int8
from minigpt.model import replace_linears

QUANTIZATIONS = ("int8", "w8a8")


class Int8Linear(nn.Module):
    """A frozen nn.Linear with its weight stored as int8 plus one scale per output channel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        # The CPU kernel takes half-precision activations and scales of the same dtype: keep those
        # scales ready instead of converting them on every call.
        self.register_buffer("half_scales", scales.to(_half_dtype(linear.weight.dtype)))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu" and self.in_features % 8 == 0:
            # torch's CPU int8 kernel is vectorized for half activations only (fp32 input measured
            # ~10x slower), so fp32 activations pass through bf16 for this product. It reads inputs
            # 8 at a time: other sizes gave wrong products or crashed (torch 2.13, AVX2), so they
            # take the dequantizing product below (GPT-2's sizes are all multiples of 64).
            half = flat.to(self.half_scales.dtype)
            out = torch.ops.aten._weight_int8pack_mm(half, self.weight, self.half_scales).to(flat.dtype)
        else:
            out = F.linear(flat, self.weight.to(flat.dtype)) * self.scales.to(flat.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class W8A8Linear(Int8Linear):
    """int8 weights and per-row dynamically quantized int8 activations, exact integer products.

    On x86 CPUs without AVX-512 the products run through fbgemm (`fbgemm_int8`), whose AVX2 kernels
    are exact only for 7-bit activations: there each row is rounded to [-63, 63] instead of
    [-127, 127], a coarser rounding of the activations for 8-26x faster products."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.fbgemm = fbgemm_int8.available(self.weight.device)
        self.levels = fbgemm_int8.ACTIVATION_LEVELS if self.fbgemm else 127
        if self.fbgemm:
            fbgemm_int8.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        row_scales = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / self.levels
        quantized = torch.round(flat / row_scales)
        if self.fbgemm:
            products = fbgemm_int8.int8_mm(quantized, self.weight)
        else:
            # weight is [out, in] contiguous: its transpose view is the column-major [in, out] operand
            # torch's int8 matmul reads fastest (measured ~1.3-2x over a contiguous [in, out] copy).
            products = torch._int_mm(quantized.to(torch.int8), self.weight.t()).float()
        out = products.mul_(row_scales).mul_(self.scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def compile_options(mode: str | None, device: torch.device) -> dict[str, object]:
    """Inductor options for compiling a model quantized with `mode` (None: not quantized) on `device`.

    Weight-only int8 on the CPU compiles with freezing and max-autotune: the weights become
    constants, which lets inductor offer its own C++ int8 x bf16 kernel next to torch's
    `_weight_int8pack_mm` and keep the faster one per shape. Measured on GPT-2 at batch 1 (2 cores,
    AVX-512): 11.4 -> 7.1 ms per token, for a first compile of ~3.5 min instead of ~1 (torch caches
    it on disk). inductor keeps frozen constants in its loaded code for the life of the process
    (~0.85 GB more per compiled gpt2 int8 engine created). w8a8 and unquantized models gain nothing
    from either (w8a8 measured slower), and GPUs were not measured, so those compile plainly.
    """
    if mode == "int8" and device.type == "cpu":
        quiet = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}
        return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", **quiet}
    return {}


def _half_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Replace every nn.Linear of `model` in place by its `mode` ("int8" or "w8a8") version."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantize must be one of {QUANTIZATIONS}, got {mode!r}")
    return replace_linears(model, Int8Linear if mode == "int8" else W8A8Linear)
