"""CUDA graphs of the decode step, captured at start for a ladder of batch sizes. B sequences replay the smallest
size b >= B from static buffers; rows B..b-1 write and read a scratch block no sequence owns. Block tables span the
model's context, so one graph serves every length. The graphs replay the runner's own eager forward."""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from minigpt.model.attention import StepMetadata

logger = logging.getLogger("minigpt")

# forward(input_ids, positions, meta, logits_rows) -> logits
Forward = Callable[[torch.Tensor, torch.Tensor, StepMetadata, torch.Tensor | None], torch.Tensor]
# capture(fn, pool) -> replay: fn recorded once, each replay() reruns it and returns its output
Capture = Callable[[Callable[[], torch.Tensor], object], Callable[[], torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16, and `max_batch` itself."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_batch} | set(range(16, max_batch, 16)) | {max_batch})


def cuda_graph_capture(fn: Callable[[], torch.Tensor], pool: object) -> Callable[[], torch.Tensor]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class DecodeGraphs:
    """A forward path for batches of up to `max(sizes)` sequences; max_blocks: the block tables' width."""

    generated_apart = False

    def __init__(self, forward: Forward, sizes: list[int], max_blocks: int, scratch_block: int, block_size: int,
                 device: torch.device, capture: Capture = cuda_graph_capture) -> None:
        self.forward, self.sizes, self.capture = forward, sizes, capture
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        rows = sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device)
        self.tables = torch.full((rows, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Every size, largest first, in one memory pool that the smaller graphs reuse."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.input_ids.is_cuda else None
        for size in reversed(self.sizes):
            self._step(size)  # warm-up outside the graph: Triton's compile, cuBLAS's handles, buffers
            self.graphs[size] = self.capture(lambda size=size: self._step(size), pool)
        logger.info("CUDA graphs: decode captured for %d batch sizes (1..%d) in %.1f s", len(self.sizes),
                    self.sizes[-1], time.perf_counter() - start)

    def _step(self, size: int) -> torch.Tensor:
        meta = StepMetadata(self.slots[:size], [], 0, self.tables[:size], self.lens[:size])
        return self.forward(self.input_ids[:size], self.positions[:size], meta, None)

    def covers(self, inputs) -> bool:
        return inputs.meta.decode_only and len(inputs.input_ids) <= self.sizes[-1]

    def bucket(self, batch: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def __call__(self, inputs) -> torch.Tensor:
        """Logits [B, vocab], copied: the next replay overwrites the graph's output."""
        meta, batch = inputs.meta, len(inputs.input_ids)
        size = self.bucket(batch)
        tables = meta.decode_block_tables
        self.input_ids[:batch].copy_(inputs.input_ids)
        self.positions[:batch].copy_(inputs.positions)
        self.slots[:batch].copy_(meta.slot_mapping)
        self.tables[:batch, : tables.shape[1]].copy_(tables)
        self.lens[:batch].copy_(meta.decode_context_lens)
        if size > batch:  # rows a larger step left are padding again
            self.slots[batch:size].fill_(self.scratch_slot)
            self.tables[batch:size].fill_(self.scratch_block)
            self.lens[batch:size].fill_(1)
        return self.graphs[size]()[:batch].clone()
