"""EngineConfig: every engine setting and its default, in one place.

`LLM(...)`, `python -m minigpt.generate` and `python -m minigpt.serve` all take these names.
The defaults let dozens of concurrent requests batch with no tuning on a laptop-class CPU.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from minigpt.torch_support import check_torch_for
from minigpt.weights import resolve_dtype

QUANTIZATIONS = ("int8", "w8a8")  # the modes of minigpt/quantize.py


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"
    """Weights, activations and (unless `kv_cache_dtype` says otherwise) the KV pool: float32 | float16 | bfloat16."""
    device: str = "cpu"
    """cpu | cuda."""
    block_size: int = 16
    """Tokens per KV page."""
    kv_cache_tokens: int | None = None
    """Pool size in tokens; None sizes it from `kv_cache_memory`."""
    kv_cache_memory: int = 1024**3
    """Pool size in bytes when `kv_cache_tokens` is None (default 1 GiB: ~14.5k tokens for gpt2
    with a float32 pool, ~29k with a half-precision one)."""
    kv_cache_dtype: str | None = None
    """KV pool: None keeps `dtype`; float16 or bfloat16 stores keys and values in half precision
    (twice the tokens in the same memory, half the bytes read by decode attention) while the
    model computes in `dtype`; attention upcasts what it reads to the query's dtype."""
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
    """None | int8 (weight-only int8 linears) | w8a8 (int8 weights and per-token int8 activations)."""
    num_threads: int | None = None
    """torch CPU threads; None keeps torch's default (one per core)."""
    compile: bool = False
    """Run decode steps (and a lone request's prompt) through torch.compile'd graphs
    (minigpt/decode_graph.py): much faster decoding, at the cost of compiling when the engine starts
    (two to four minutes on 2 cores the first time, the most with quantize="int8"; torch's on-disk
    cache makes later starts take seconds, except with quantize="w8a8" on a CPU with AVX-512 VNNI,
    whose frozen graphs torch cannot cache: ~2-3 min at every start, see quantize.compile_options)."""
    max_waiting: int = 4096
    """Requests allowed to wait in the queue of the concurrent front; more are refused at once."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_waiting"):
            _check_positive(name, getattr(self, name))
        for name in ("kv_cache_tokens", "num_threads"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), " or None")
        for name in ("enable_prefix_caching", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.kv_cache_dtype is not None:
            try:
                resolve_dtype(self.kv_cache_dtype)  # names, or a torch.dtype as `dtype` takes
            except ValueError:
                raise ValueError(
                    f"kv_cache_dtype must be None, float32, float16 or bfloat16, got {self.kv_cache_dtype!r}"
                ) from None
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ValueError(f"quantize must be None or one of {QUANTIZATIONS}, got {self.quantize!r}")
        if self.compile:
            check_torch_for("compile=True")
        if self.quantize is not None:
            check_torch_for(f"quantize={self.quantize!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, owner: str, kwargs: dict) -> EngineConfig:
        """The config for `owner(model, **kwargs)`, naming any argument that is not a field."""
        unknown = set(kwargs) - set(cls.field_names())
        if unknown:
            raise TypeError(f"unknown {owner} argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)


def _check_positive(name: str, value: object, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer{alternative}, got {value!r}")


# What an engine refuses to start or run with, for the command lines to report in one line and exit 2:
# bad arguments, a missing or broken checkpoint, a KV pool larger than memory, a compile that failed.
USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError, MemoryError)


def error_line(err: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags every command line takes (generate, serve), defaults from EngineConfig."""
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default=EngineConfig.dtype, help="float32 | float16 | bfloat16")
    engine.add_argument("--device", default=EngineConfig.device, help="cpu | cuda")
    engine.add_argument("--quantize", default=None, choices=QUANTIZATIONS,
                        help="int8: weight-only int8 linears; w8a8: int8 weights and activations")
    engine.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens")
    engine.add_argument("--kv-cache-dtype", default=None, choices=("float32", "float16", "bfloat16"),
                        help="KV pool dtype (default: --dtype); float16/bfloat16 halve its bytes")
    engine.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    engine.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    engine.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    engine.add_argument("--attention-backend", default=EngineConfig.attention_backend, help="auto | torch | triton")
    engine.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    engine.add_argument("--compile", action="store_true",
                        help="torch.compile the decode steps (faster decoding; 2-4 min to start the first time, "
                        "and every time with --quantize w8a8 on AVX-512 VNNI CPUs)")
    engine.add_argument("--max-waiting", type=int, default=EngineConfig.max_waiting,
                        help="queued requests beyond which new ones are refused at once")


def engine_args_from(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the flags of `add_engine_arguments`."""
    return dict(
        dtype=args.dtype, device=args.device, quantize=args.quantize, kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
        num_threads=args.threads, max_waiting=args.max_waiting, compile=args.compile,
    )
