"""minigpt: a GPT-2 inference engine written from scratch in PyTorch."""

from minigpt.async_engine import AsyncLLM, QueueFullError
from minigpt.beam_params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minigpt.llm import LLM
from minigpt.request import CompletionOutput, RequestOutput
from minigpt.request_handle import RequestHandle, StreamDelta
from minigpt.sampling import SamplingParams, StructuredOutputsParams

__all__ = [
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
__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads this literal without importing
