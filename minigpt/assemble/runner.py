"""The model runner an EngineConfig asks for."""

from __future__ import annotations

from pathlib import Path

from minigpt.engine.config import EngineConfig
from minigpt.engine.runner import ModelRunner


def build_runner(path: Path, config: EngineConfig) -> ModelRunner:
    """The engine's model runner: one process's, or rank 0's of a tensor-parallel group."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(path, config)
    from minigpt.tensor_parallel.runner import TensorParallelRunner

    return TensorParallelRunner(path, config)
