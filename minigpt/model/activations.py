"""The activation functions a GPT-2 config.json may name, by that name."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_accurate(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's `gelu_new`; compiled as x * sigmoid(2u), the same function, as inductor's tanh is slower."""
    if torch.compiler.is_compiling():
        return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x))
    return F.gelu(x, approximate="tanh")


# Same functions as transformers' ACT2FN, so fp32 logits agree to rounding.
ACTIVATIONS = {
    "gelu_new": gelu_tanh,
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_python_tanh": _gelu_accurate,
    "gelu_fast": _gelu_fast,
    "gelu_accurate": _gelu_accurate,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "linear": lambda x: x,
}
