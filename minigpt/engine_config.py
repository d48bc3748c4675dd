"""EngineConfig: every engine setting and its default, in one place.

`LLM(...)`, `python -m minigpt.generate` and `python -m minigpt.serve` all take these names.
The defaults let dozens of concurrent requests batch with no tuning on a laptop-class CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

QUANTIZATIONS = (None, "int8")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"
    """Weights, activations and KV pool: float32 | float16 | bfloat16."""
    device: str = "cpu"
    """cpu | cuda."""
    block_size: int = 16
    """Tokens per KV page."""
    kv_cache_tokens: int | None = None
    """Pool size in tokens; None sizes it from `kv_cache_memory`."""
    kv_cache_memory: int = 1024**3
    """Pool size in bytes when `kv_cache_tokens` is None (default 1 GiB: ~14.5k tokens for gpt2
    in fp32, ~29k in bf16)."""
    max_num_seqs: int = 128
    """Sequences decoded together in one step."""
    max_num_batched_tokens: int = 2048
    """Tokens computed in one step (prompt chunks + one per decoding sequence); longer prompts
    are prefilled in chunks."""
    enable_prefix_caching: bool = True
    """Reuse the pages of a common prompt prefix instead of recomputing it."""
    attention_backend: str = "auto"
    """auto | torch | triton: auto takes Triton on CUDA when it imports, torch elsewhere."""
    quantize: str | None = None
    """None | int8 (weight-only int8 linears)."""
    num_threads: int | None = None
    """torch CPU threads; None keeps torch's default (one per core)."""
    max_waiting: int = 4096
    """Requests allowed to wait in the queue of the concurrent front; more are refused at once."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_waiting"):
            _check_positive(name, getattr(self, name))
        for name in ("kv_cache_tokens", "num_threads"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), " or None")
        if self.quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be one of {QUANTIZATIONS}, got {self.quantize!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _check_positive(name: str, value: object, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{alternative}, got {value!r}")
