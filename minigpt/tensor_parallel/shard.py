"""Megatron-style shards of GPT-2: `c_attn` (by whole heads) and `c_fc` column-parallel, both `c_proj`s
row-parallel with one all-reduce after each; embeddings, layernorms and head replicated. Slices are taken in
the checkpoint's Conv1D layout ([in, out]) by indexing only, so safetensors reads just the rank's bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from minigpt.model.config import GPT2Config

COLUMN_PARALLEL = ("attn.c_attn", "mlp.c_fc")
ROW_PARALLEL = ("attn.c_proj", "mlp.c_proj")


def check_divisible(config: GPT2Config, world: int) -> None:
    for name, value in (("n_head", config.n_head), ("n_embd", config.n_embd), ("the MLP width", config.inner_dim)):
        if value % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide {name}={value}: "
                             "each rank must hold a whole share of the heads and widths")


@dataclass
class Shard:
    """Rank `rank` of `world`, a `WeightLayout`; `all_reduce(tensor)` (in place) is set once the group is joined."""

    rank: int
    world: int
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def cache_config(self, config: GPT2Config) -> GPT2Config:
        """A rank's KV pool shape: its heads only."""
        return replace(config, n_head=config.n_head // self.world, n_embd=config.n_embd // self.world)

    def resize(self, model: nn.Module) -> None:
        """Shrink a meta GPT2's sharded linears and head counts to this rank's share."""
        for block in model.h:
            attn, mlp = block.attn, block.mlp
            attn.n_head //= self.world
            attn.c_attn = self._linear(attn.c_attn, out_div=self.world)
            attn.c_proj = self._linear(attn.c_proj, in_div=self.world)
            mlp.c_fc = self._linear(mlp.c_fc, out_div=self.world)
            mlp.c_proj = self._linear(mlp.c_proj, in_div=self.world)

    @staticmethod
    def _linear(linear: nn.Linear, out_div: int = 1, in_div: int = 1) -> nn.Linear:
        return nn.Linear(linear.in_features // in_div, linear.out_features // out_div)

    def take(self, key: str, source: Any) -> torch.Tensor:
        """This rank's part of checkpoint tensor `key` (no "transformer." prefix): a slice handle or a tensor."""
        layer_key = key.split(".", 2)[-1] if key.startswith("h.") else ""
        name, _, kind = layer_key.rpartition(".")
        if name == "attn.c_attn":  # [C, 3C] weight, [3C] bias: q | k | v, each split by heads
            width = _shape(source)[-1] // 3
            return torch.cat([self._span(source, kind, part * width, width) for part in range(3)], dim=-1)
        if name == "mlp.c_fc":
            return self._span(source, kind, 0, _shape(source)[-1])
        if name in ROW_PARALLEL and kind == "weight":  # [in, C]: this rank's rows of the inputs
            rows = _shape(source)[0] // self.world
            return source[self.rank * rows : (self.rank + 1) * rows, :]
        if name in ROW_PARALLEL and kind == "bias":  # summed by the all-reduce: rank 0 alone adds it
            return source[:] if self.rank == 0 else torch.zeros_like(source[:])
        return source[:]

    def _span(self, source: Any, kind: str, offset: int, width: int) -> torch.Tensor:
        """This rank's 1/world of columns [offset, offset + width)."""
        step = width // self.world
        cols = slice(offset + self.rank * step, offset + (self.rank + 1) * step)
        return source[:, cols] if kind == "weight" else source[cols]

    def reduce_projections(self, model: nn.Module) -> None:
        """Hook an all-reduce onto each row-parallel `c_proj` (whatever linear sits there by then)."""
        for block in model.h:
            for linear in (block.attn.c_proj, block.mlp.c_proj):
                linear.register_forward_hook(self._reduce_output)

    def _reduce_output(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        self.all_reduce(output)
        return output


def _shape(source: Any) -> list[int]:
    return list(source.get_shape()) if hasattr(source, "get_shape") else list(source.shape)
