"""minigpt: a GPT-2 inference engine written from scratch in PyTorch."""

import warnings

with warnings.catch_warnings():  # torch warns at its import where numpy is absent; minigpt runs without numpy
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch  # noqa: F401

from minigpt.async_llm.async_engine import AsyncLLM, QueueFullError
from minigpt.async_llm.request_handle import RequestHandle, StreamDelta
from minigpt.beam.params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minigpt.common.version import __version__
from minigpt.engine.request import CompletionOutput, RequestOutput
from minigpt.llm import LLM
from minigpt.sampling import SamplingParams, StructuredOutputsParams

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "AsyncLLM",
    "RequestHandle",
    "StreamDelta",
    "QueueFullError",
]
