"""The ranks' process group (gloo on the CPU, NCCL on CUDA) over a local TCP store; not torch.distributed's
default group, so a process can hold several."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a rank that stops answering fails the step after this
JOIN_TIMEOUT = timedelta(seconds=120)  # the ranks have loaded their shards: joining is quick


def open_store(world: int) -> dist.TCPStore:
    """Rank 0's store, on a free port of this machine (`store.port`)."""
    return dist.TCPStore("127.0.0.1", 0, world, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)


def join_store(port: int, world: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world, False, timeout=JOIN_TIMEOUT)


def open_group(store: dist.Store, rank: int, world: int, device: torch.device) -> dist.ProcessGroup:
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, COLLECTIVE_TIMEOUT)


def all_reducer(group: dist.ProcessGroup) -> Callable[[torch.Tensor], None]:
    def all_reduce(tensor: torch.Tensor) -> None:
        group.allreduce([tensor]).wait()

    return all_reduce


def close_group(group: dist.ProcessGroup | None) -> None:
    """Release the group's connections (peers may already be gone)."""
    if group is not None and hasattr(group, "shutdown"):
        try:
            group.shutdown()
        except RuntimeError:
            pass
