"""bf16 linears with their weights kept in oneDNN's packed layout, for the CPU.

torch's bf16 `F.linear` on the CPU hands oneDNN a plain [out, in] weight, which it reorders into
its blocked layout on every call. Reordering once, at load, and calling oneDNN's linear on the
packed weight is what inductor's freezing does for bf16; done here it serves eager and compiled
steps alike. Measured on GPT-2's linears (2 cores, AVX-512 bf16): the linears of a batch-1 step
17.4 -> 12.0 ms, of a batch-32 step 65 -> 54 ms. The products are oneDNN's either way: on the random gpt2 checkpoint
the model's bf16 logits came out bit-identical with and without packing.

The packed weight is an opaque `torch._mkldnn` tensor, so the product is a custom op: torch.compile
sees it as one extern call and never looks inside.
Opaque also means a packed model cannot be deep-copied, saved or cast: load a fresh `GPT2` for that.
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations as types.
import torch
import torch.nn as nn

from minigpt.model import replace_linears


@torch.library.custom_op("minigpt::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias, with W packed by `mkldnn._reorder_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed_weight.shape[0])


class PackedLinear(nn.Module):
    """A frozen bf16 nn.Linear whose weight lives only in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed_weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU whose oneDNN supports bf16 (measured to pay on AVX-512 bf16; oneDNN emulates bf16
    on older x86 CPUs, where packing was not measured)."""
    return (
        dtype == torch.bfloat16
        and device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of a bf16 `model` in place by its PackedLinear."""
    return replace_linears(model, PackedLinear)
