"""Unquantized CPU linears, the fastest product per dtype and CPU: `PackedLinear`, `HalfWeightLinear`; ops of our
own, opaque to export (a packed weight found by its handle's address), so such a model cannot be copied or cast."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from minigpt.common.cpu_class import usable_flags

SMALL_BATCH = 8  # rows up to which the half kernel beats upcasting to fp32
TILE_ROWS = 16  # rows in every product of a `RowTiles` linear
UPCAST_ROWS = 4096  # weight rows upcast at a time
_PACKED: dict[int, torch.Tensor] = {}  # data_ptr of a PackedLinear's handle -> its weight in oneDNN's layout


def _packed_linear(x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[handle.data_ptr()], bias, "none", [], "")


def _half_weight_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, weight.shape[1])
    if flat.shape[0] <= SMALL_BATCH:
        return F.linear(x, weight, bias)
    flat = flat.float()
    out = flat.new_empty(flat.shape[0], weight.shape[0], dtype=x.dtype)
    for start in range(0, weight.shape[0], UPCAST_ROWS):
        rows = slice(start, start + UPCAST_ROWS)
        part_bias = None if bias is None else bias[rows].float()
        out[:, rows] = torch.ops.mkldnn._linear_pointwise(flat, weight[rows].float(), part_bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _linear_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_LIBRARY = torch.library.Library("minigpt", "FRAGMENT")
for _name, _kernel in (("packed_linear", _packed_linear), ("half_weight_linear", _half_weight_linear)):
    _LIBRARY.define(f"{_name}(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"minigpt::{_name}", _linear_shape, lib=_LIBRARY)


class PackedLinear(nn.Module):
    """The weight reordered once into oneDNN's blocked layout, living as long as `handle`."""

    fixed_addresses = ("handle",)  # its address keys the packed weight: `huge_pages` leaves it in place

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        handle = torch.empty(self.out_features, dtype=torch.uint8, device=linear.weight.device)
        _PACKED[handle.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        weakref.finalize(handle, _PACKED.pop, handle.data_ptr(), None)
        self.register_buffer("handle", handle, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.minigpt.packed_linear.default(x, self.handle, self.bias)


class HalfWeightLinear(nn.Module):
    """A frozen half nn.Linear: the half kernel up to `SMALL_BATCH` rows, else upcast to fp32 by oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.minigpt.half_weight_linear.default(x, self.weight, self.bias)


class RowTiles(nn.Module):
    """A linear run `TILE_ROWS` rows at a time (a product's reduction order follows its rows): batch_invariant."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear, self.in_features, self.out_features = linear, linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        padded = F.pad(flat, (0, 0, 0, -rows % TILE_ROWS))
        out = torch.cat([self.linear(tile) for tile in padded.split(TILE_ROWS)])[:rows]
        return out.reshape(*x.shape[:-1], self.out_features)


def tile_rows(model: nn.Module) -> nn.Module:
    for module in list(model.modules()):
        if isinstance(module, RowTiles):
            continue
        for name, child in list(module.named_children()):
            if hasattr(child, "in_features") and not isinstance(child, RowTiles):
                setattr(module, name, RowTiles(child))
    return model


@functools.cache
def native_bf16() -> bool:
    """oneDNN runs bf16 and the CPU multiplies it natively (avx512_bf16 or AMX, not just AVX-512)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    flags = usable_flags()
    return flags is None or not flags.isdisjoint({"avx512_bf16", "amx_bf16"})


def cpu_linear_for(dtype: torch.dtype, device: torch.device) -> type[nn.Module] | None:
    """The linear a `dtype` model on `device` runs fastest with; None keeps nn.Linear."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.float32:
        return PackedLinear if torch.backends.cpu.get_cpu_capability() == "AVX2" else None
    native = {torch.bfloat16: native_bf16, torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
    if dtype not in native:
        return None
    if not native[dtype]():
        return HalfWeightLinear
    return PackedLinear if dtype == torch.bfloat16 else None  # packed fp16 was slower on GPT-2's head


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Swap every nn.Linear of `model` in place for `make(linear)` (quantized, packed, ...)."""
    parents = [module for module in model.modules() if not isinstance(module, nn.Linear)]
    for module in parents:  # each replaced one is freed at once, not when all are
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    return model


def prepare_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    kind = cpu_linear_for(dtype, device)
    return model if kind is None else replace_linears(model, kind)
