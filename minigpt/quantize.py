"""int8 linears, two ways; every nn.Linear of the model (attention, MLP, LM head) is replaced.

- `int8` (weight-only): weights rounded per output channel (absmax / 127), activations untouched:
  `x @ W_int8^T * scale + bias`, gpt-fast's recipe. A quarter of fp32's weight bytes.
- `w8a8`: the same int8 weights, and each activation row quantized to int8 on the fly with its own
  scale, so the product runs as an int8 x int8 matrix multiply (VNNI on x86 CPUs). Per-row (per
  token) scales keep a request's result independent of what else is in the batch. Faster than
  weight-only on the CPU at every batch size measured, at some accuracy cost (see tests).
  Compiled with freezing on a CPU with VNNI, the products run through inductor's own int8 GEMM
  (`vnni_gemm`); eager, through `torch._int_mm`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt import fbgemm_int8
from minigpt.engine_config import QUANTIZATIONS
from minigpt.model import replace_linears

try:  # defines torch.ops.quantized_decomposed, the ops of PyTorch's quantization patterns
    from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401
except ImportError:  # a torch without them: w8a8 keeps torch._int_mm when compiled too
    pass


def _vnni_cpu(device: torch.device) -> bool:
    """`device` is a CPU with AVX-512 VNNI whose w8a8 products are `torch._int_mm`'s (not fbgemm's),
    and torch has the quantization ops of `_dequantized_product`. Cheap: no inductor import."""
    vnni = getattr(torch.cpu, "_is_vnni_supported", lambda: False)
    return (
        device.type == "cpu"
        and vnni()
        and not fbgemm_int8.available(device)
        and hasattr(torch.ops.quantized_decomposed, "dequantize_per_channel")
    )


@functools.cache
def _inductor_has_vnni_gemm() -> bool:
    """inductor's C++ GEMM has its AVX-512 VNNI u8 x s8 kernel (recent torch). Without it, the
    pattern becomes oneDNN's `qlinear_pointwise`, slower than `torch._int_mm` at batch 1 here."""
    try:
        import torch._inductor.compile_fx  # noqa: F401  (imports the codegen modules in a working order)
        from torch._inductor.codegen import cpp_micro_gemm
    except ImportError:  # a torch whose inductor is laid out otherwise: keep torch._int_mm
        return False
    return hasattr(cpp_micro_gemm, "CppMicroGemmAVX512VNNI")


def vnni_gemm(device: torch.device) -> bool:
    """Frozen compiled graphs of w8a8 run inductor's int8 GEMM on `device` (see "Where the time goes"
    in the README): inductor turns the pattern of PyTorch's own int8 quantization
    (`_dequantized_product`) into a C++ GEMM over the weight packed once, at compile time, for its
    VNNI kernel; `torch._int_mm` hands oneDNN the plain weight on every call. Imports inductor."""
    return _vnni_cpu(device) and _inductor_has_vnni_gemm()


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
        self.vnni = _vnni_cpu(self.weight.device)
        self.levels = fbgemm_int8.ACTIVATION_LEVELS if self.fbgemm else 127
        if self.fbgemm:
            fbgemm_int8.pack(self.weight)
        if self.vnni:  # constants of the frozen graphs, as inductor's int8 GEMM requires
            unit_scales = torch.ones(self.out_features, dtype=torch.float32, device=self.weight.device)
            self.register_buffer("unit_scales", unit_scales, persistent=False)
            self.register_buffer("zero_points", torch.zeros_like(unit_scales, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        row_scales = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / self.levels
        quantized = torch.round(flat / row_scales)
        if self.fbgemm:
            products = fbgemm_int8.int8_mm(quantized, self.weight)
        elif self.vnni and torch.compiler.is_compiling() and _frozen_compile():
            products = _dequantized_product(quantized, self.weight, self.unit_scales, self.zero_points)
        else:
            # weight is [out, in] contiguous: its transpose view is the column-major [in, out] operand
            # torch's int8 matmul reads fastest (measured ~1.3-2x over a contiguous [in, out] copy).
            products = torch._int_mm(quantized.to(torch.int8), self.weight.t()).float()
        out = products.mul_(row_scales).mul_(self.scales)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def _frozen_compile() -> bool:
    """The graph being traced is one inductor freezes (it does so only without autograd)."""
    return torch._inductor.config.freezing and not torch.is_grad_enabled()


def _dequantized_product(
    quantized: torch.Tensor, weight: torch.Tensor, unit_scales: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """quantized [M, in] (integers in [-127, 127], fp32) @ weight [out, in]^T (int8), written as the
    pattern inductor's freezing pass replaces by its int8 GEMM (`vnni_gemm`); never run eagerly (it
    would dequantize the whole weight). The activations go in shifted to unsigned bytes, as VNNI
    multiplies unsigned by signed bytes; inductor subtracts the shift (128 x each weight row's sum).
    Weight scales of 1 keep the products the integers `torch._int_mm` returns (exact in fp32 up to
    2^24: here the shifted sums), scaled afterwards in the same order as eager."""
    ops = torch.ops.quantized_decomposed
    shifted = (quantized + 128).to(torch.uint8)
    x = ops.dequantize_per_tensor.default(shifted, 1.0, 128, 0, 255, torch.uint8)
    w = ops.dequantize_per_channel.default(weight, unit_scales, zero_points, 0, -128, 127, torch.int8)
    return torch.mm(x, w.t())


def compile_options(mode: str | None, device: torch.device) -> dict[str, object]:
    """Inductor options for compiling a model quantized with `mode` (None: not quantized) on `device`.

    Both int8 modes compile with freezing and max-autotune on the CPU where inductor has an int8
    kernel for them: the weights become constants, so inductor can offer its own C++ kernels beside
    torch's and keep the faster one per shape. Frozen w8a8 graphs hold oneDNN-packed weights that
    torch's graph cache cannot store, so they compile at every start and hold more memory. The other
    cases were not measured faster frozen, and compile plainly.
    """
    if device.type == "cpu" and (mode == "int8" or (mode == "w8a8" and vnni_gemm(device))):
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
