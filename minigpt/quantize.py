"""Weight-only int8: each linear's weight rounded per output channel, activations untouched.

Matrix-vector products are bound by reading the weights, so a quarter of the bytes of fp32 is
most of the speed at batch 1. Scales are per output row (absmax / 127), the recipe gpt-fast
uses; the output is `x @ W_int8^T * scale + bias`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        if flat.device.type == "cpu":
            # torch's CPU int8 kernel is vectorized for half activations only (fp32 input measured
            # ~10x slower), so fp32 activations pass through bf16 for this product.
            half = flat.to(self.half_scales.dtype)
            out = torch.ops.aten._weight_int8pack_mm(half, self.weight, self.half_scales).to(flat.dtype)
        else:
            out = F.linear(flat, self.weight.to(flat.dtype)) * self.scales.to(flat.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def _half_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of `model` (attention, MLP and the LM head) in place."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
