"""int8 x int8 products on x86 CPUs without AVX-512 (where `torch._int_mm` runs a naive loop): fbgemm, and where
the CPU has AVX-VNNI, oneDNN's product for `ONEDNN_ROWS` rows and more (faster there, the same integers).
AVX2's `vpmaddubsw` saturates 16-bit pair sums: 7-bit activations (offset by 64 into [1, 127]) keep fbgemm's
products exact. The packed weight is a torchbind object compile cannot trace, so the product is an op of our own."""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

from minigpt.common.cpu_class import usable_flags
from minigpt.quant import int8_rows

ACTIVATION_LEVELS = 63  # activations are rounded to integers in [-63, 63]
ONEDNN_ROWS = 32  # rows from which oneDNN's AVX-VNNI product beats fbgemm's
_ZERO_POINT = 64
_OPS = ("linear_prepack", "linear_with_input_q_dq_qweight_dq_output_fp32")  # the quantized ops used here
_PACKED: dict[int, torch.ScriptObject] = {}  # data_ptr of an int8 weight -> its fbgemm packing


def built_in() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and all(
        hasattr(torch.ops.quantized, op) for op in _OPS
    )


def available(device: torch.device) -> bool:
    """fbgemm is the fast int8 product here: AVX2 only (with AVX-512 `torch._int_mm` runs oneDNN's, faster)."""
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX2" and built_in()


def pack(weight: torch.Tensor) -> None:
    """Pack an int8 [out, in] weight for `int8_mm` while the tensor lives."""
    with warnings.catch_warnings():  # torch deprecates quantized tensors; fbgemm's packing takes one
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_tensor_quantized_tensor(weight, 1.0, 0)
        _PACKED[weight.data_ptr()] = torch.ops.quantized.linear_prepack(quantized, None)
    weakref.finalize(weight, _PACKED.pop, weight.data_ptr(), None)


@functools.cache
def avx_vnni() -> bool:
    return "avx_vnni" in (usable_flags() or ())


def _int8_mm(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None and x.shape[0] <= int8_rows.ROWS:  # a batch of a few rows, in a program of any batch
        return int8_rows.rows_mm(x.to(torch.int8), packed, weight.shape[0])
    if x.shape[0] >= ONEDNN_ROWS and avx_vnni():
        return torch._int_mm(x.to(torch.int8), weight.t()).float()
    packed = _PACKED.get(weight.data_ptr())
    if packed is None:
        raise RuntimeError("this int8 weight was not packed for fbgemm (fbgemm_int8.pack)")
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, _ZERO_POINT, packed)


def _int8_mm_shape(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_LIBRARY = torch.library.Library("minigpt", "FRAGMENT")
_LIBRARY.define("fbgemm_int8_mm(Tensor x, Tensor weight, Tensor? packed=None) -> Tensor")
_LIBRARY.impl("fbgemm_int8_mm", _int8_mm, "CPU")
torch.library.register_fake("minigpt::fbgemm_int8_mm", _int8_mm_shape, lib=_LIBRARY)
int8_mm = torch.ops.minigpt.fbgemm_int8_mm.default
"""x [M, in] fp32 holding integers in [-63, 63], weight [out, in] int8 (packed with `pack`), and optionally its
`int8_rows.pack`, through which `int8_rows.ROWS` rows or fewer go -> x @ weight^T [M, out], exact integers in fp32."""
