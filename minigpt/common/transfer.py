"""Host values to device tensors and back: pinned and non-blocking on CUDA, as a pageable copy syncs the stream."""

from __future__ import annotations

from array import array

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = _host_tensor(values, dtype)
    if device.type == "cuda":
        pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)  # torch's host cache reuses it once copied
        return pinned.copy_(host).to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


def _host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    if dtype is torch.int64 and values:
        return torch.frombuffer(array("q", values), dtype=torch.int64)  # a C loop: torch.tensor's is 3x slower
    return torch.tensor(values, dtype=dtype)


class HostCopy:
    """A device tensor on its way to the host, read with `tolist`: on CUDA copied into pinned memory behind an
    event, so reading waits for the work queued before the copy and not for what was queued after it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
