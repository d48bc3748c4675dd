"""A loaded model's CPU tensors moved into memory that Linux may back with 2 MiB pages (transparent huge pages,
asked for with `madvise`): each token reads every weight once, and on 4 KiB pages that stream meets a TLB miss and
a stop of the hardware prefetcher every 4 KiB. `MINIGPT_HUGE_PAGES=0` leaves the tensors where they are. (Not the
KV pool: its pages in huge pages made the attention slower, scripts/PERFORMANCE.md.)

The tensors keep their identity, dtype, shape, strides and values; each storage moves whole into its own slice of
one mapping (views and tied weights stay views and tied), and each slice is a storage of its own, so no two tensors
that were apart come to share one. Where the kernel gives no huge pages (THP off) the mapping is ordinary memory."""

from __future__ import annotations

import mmap
import os
import sys

import torch
import torch.nn as nn

SWITCH = "MINIGPT_HUGE_PAGES"
HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # of each storage in the mapping, as torch's own CPU allocator aligns


def huge_pages_on() -> bool:
    return sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(SWITCH, "1") != "0"


def round_up(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


def huge_page_bytes(nbytes: int) -> memoryview:
    """`nbytes` of zeroed anonymous memory starting on a 2 MiB boundary, advised to be backed by huge pages."""
    size = round_up(nbytes, HUGE_PAGE)
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    advise_huge_pages(mapping, start, size)
    return memoryview(mapping)[start : start + nbytes]  # the view keeps the mapping alive


def advise_huge_pages(mapping: mmap.mmap, start: int, size: int) -> None:
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    except OSError:  # a kernel built without transparent huge pages (EINVAL): ordinary pages
        pass


def move_to_huge_pages(module: nn.Module) -> int:
    """Move `module`'s CPU parameters and buffers into huge-page memory, in place, but for those a submodule names
    in its `fixed_addresses` (a tensor whose address keys something else); the bytes moved (0 where
    `huge_pages_on` is False)."""
    if not huge_pages_on():
        return 0
    tensors = {}
    for submodule in module.modules():
        fixed = getattr(submodule, "fixed_addresses", ())
        for name, tensor in (*submodule.named_parameters(recurse=False), *submodule.named_buffers(recurse=False)):
            if name not in fixed and tensor.device.type == "cpu" and tensor.numel():
                tensors[id(tensor)] = tensor
    groups = {}  # a storage's own identity -> the tensors on it, which come to share its new storage
    for tensor in tensors.values():
        groups.setdefault(tensor.untyped_storage()._cdata, []).append(tensor)
    sizes = [group[0].untyped_storage().nbytes() for group in groups.values()]
    spans = [round_up(size, ALIGNMENT) for size in sizes]  # each storage's slice of the mapping
    total = sum(spans)
    if not total:
        return 0
    memory, start = huge_page_bytes(total), 0
    with torch.no_grad():
        for group, size, span in zip(groups.values(), sizes, spans, strict=True):
            new = torch.frombuffer(memory[start : start + size], dtype=torch.uint8)
            new.copy_(torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage()))
            for tensor in group:  # the old storage is freed with its last tensor moved, where nothing else holds it
                tensor.set_(new.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
            start += span
    return total
