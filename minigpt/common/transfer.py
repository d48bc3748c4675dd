"""Host values to device tensors without stalling a GPU.

A copy from pageable memory synchronizes the CUDA stream, so the host could not queue the next
step while the GPU runs this one; pinned memory and a non-blocking copy avoid that. On the CPU it
is a plain `torch.tensor`.
"""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)
