"""The model runner an EngineConfig asks for: the model loaded with its linears, then its forward path."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.common.huge_pages import move_to_huge_pages
from minigpt.engine.config import EngineConfig
from minigpt.engine.cuda_graphs import DecodeGraphs, capture_sizes
from minigpt.engine.runner import ModelRunner
from minigpt.model.gpt2 import GPT2, load_model
from minigpt.model.linears import prepare_linears, tile_rows
from minigpt.model.weights import resolve_device, resolve_dtype

if TYPE_CHECKING:
    from minigpt.tensor_parallel.shard import Shard


def build_runner(path: Path, config: EngineConfig) -> ModelRunner:
    """The engine's model runner: one process's, or rank 0's of a tensor-parallel group."""
    if config.tensor_parallel_size > 1:
        from minigpt.tensor_parallel.runner import TensorParallelRunner

        return TensorParallelRunner(path, config, load_model_for)
    graphs = resolve_device(config.device).type == "cuda" and not (config.enforce_eager or config.compile)
    runner = ModelRunner(load_model_for(path, config), config, spare_blocks=int(graphs))
    if config.compile:
        from minigpt.compile.cache import ProgramCache
        from minigpt.compile.steps import CompiledSteps

        runner.forward_path = CompiledSteps(runner.model, runner.pool, ProgramCache(config.compile_cache_dir))
    elif graphs:
        max_blocks = -(-runner.model.config.n_positions // config.block_size)
        runner.forward_path = DecodeGraphs(runner.forward, capture_sizes(config.max_num_seqs), max_blocks,
                                      runner.pool.num_blocks, config.block_size, runner.device)
        runner.forward_path.capture_all()
    return runner


def load_model_for(path: Path, config: EngineConfig, shard: Shard | None = None) -> GPT2:
    """The model (or a rank's `shard`) with the linears `config` asks for and the shard's all-reduces."""
    dtype, device = resolve_dtype(config.dtype), resolve_device(config.device)
    model = load_model(path, dtype, device, layout=shard)
    if config.quantize is not None:
        from minigpt.quant.quantize import quantize

        quantize(model, config.quantize)
    else:
        prepare_linears(model, dtype, device)
    if config.invariance.tiled_linears:
        tile_rows(model)
    if shard is not None:
        shard.reduce_projections(model)
    move_to_huge_pages(model)  # last: every tensor the steps read is in place
    return model
