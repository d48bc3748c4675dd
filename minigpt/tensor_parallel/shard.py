"""Megatron-style sharding of GPT-2 over `world` ranks: which slice of each weight a rank holds.

Per block, `c_attn` is column-parallel by whole heads (each of q, k and v split by heads) and `c_fc`
column-parallel by output features: a rank computes its heads' attention and its share of the MLP's
hidden units with no communication. Both `c_proj`s are row-parallel: each rank multiplies its slice of
the inputs, and one all-reduce sums the partial outputs. Embeddings, layernorms and the LM head are
replicated. A rank's model is the same `GPT2` with smaller linears and `n_head / world` heads per
attention: the layer loop does not know it is sharded, except through the all-reduce hooks.

Slices are taken in the checkpoint's Conv1D layout ([in, out]), before the loader transposes them, with
indexing only, so a safetensors `get_slice` handle reads just the rank's bytes.
"""

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
    """Refuse a model whose heads, width or MLP width `world` ranks cannot share evenly."""
    for name, value in (("n_head", config.n_head), ("n_embd", config.n_embd), ("the MLP width", config.inner_dim)):
        if value % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide {name}={value}: "
                             "each rank must hold a whole share of the heads and widths")


@dataclass
class Shard:
    """Rank `rank` of `world`. `all_reduce(tensor)` sums a tensor over the ranks in place; it is set
    once the ranks have joined their group, after the weights are loaded."""

    rank: int
    world: int
    all_reduce: Callable[[torch.Tensor], None] | None = None

    def cache_config(self, config: GPT2Config) -> GPT2Config:
        """The config a rank's KV pool is shaped by: its heads only (head_dim unchanged)."""
        return replace(config, n_head=config.n_head // self.world, n_embd=config.n_embd // self.world)

    def resize(self, model: nn.Module) -> None:
        """Shrink a GPT2's sharded linears and head counts to this rank's share (built on the meta device,
        before its weights are loaded)."""
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
        """This rank's part of checkpoint tensor `key` (no "transformer." prefix), in the file's layout.
        `source`: a safetensors slice handle or a tensor, indexed only."""
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
        """Columns [offset, offset + width) of the last dim, this rank's 1/world of them."""
        step = width // self.world
        cols = slice(offset + self.rank * step, offset + (self.rank + 1) * step)
        return source[:, cols] if kind == "weight" else source[cols]

    def reduce_projections(self, model: nn.Module) -> None:
        """Sum each row-parallel `c_proj`'s partial output over the ranks, right after it is computed
        (whatever linear, plain, packed or quantized, sits there by then)."""
        for block in model.h:
            for linear in (block.attn.c_proj, block.mlp.c_proj):
                linear.register_forward_hook(self._reduce_output)

    def _reduce_output(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        self.all_reduce(output)
        return output


def _shape(source: Any) -> list[int]:
    return list(source.get_shape()) if hasattr(source, "get_shape") else list(source.shape)
