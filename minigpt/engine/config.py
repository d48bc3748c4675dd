"""EngineConfig: every engine setting, its default and its help; the command lines' engine flags come from it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from minigpt.common.errors import Named, ParamError
from minigpt.common.torch_support import check_torch_for
from minigpt.engine.speculative_config import SpeculativeConfig
from minigpt.model.attention import INVARIANT_KEYS
from minigpt.model.weights import resolve_dtype

QUANTIZATIONS = ("int8", "w8a8")  # the modes of minigpt/quant/quantize.py
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16")  # names the CLI offers; LLM also takes aliases
OVERLAP_MODES = ("auto", "on", "off")


def _setting(default: object, help: str, flag: str | None = "", choices: tuple[str, ...] | None = None) -> Any:
    """A field, its help and its flag: `--field-name` unless `flag` names another (None: no flag)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})

@dataclass(frozen=True)
class BatchInvariance:
    """`attention`: every query through the invariant attention (its keys in fixed tiles); `tiled_linears`: float
    linears run a fixed count of rows at a time (w8a8's integer products are per row already); `holds`: a
    request's bits do not depend on its company, which the server reports."""

    attention: bool
    tiled_linears: bool
    holds: bool


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = _setting("float32", "float32 | float16 | bfloat16: weights, activations and (by default) the KV pool")
    device: str = _setting("cpu", "cpu | cuda")
    block_size: int = _setting(16, "tokens per KV block")
    kv_cache_tokens: int | None = _setting(None, "KV pool size in tokens (default: what kv_cache_memory bytes hold)")
    kv_cache_memory: int = _setting(1024**3, "KV pool size in bytes when kv_cache_tokens is None", flag=None)
    kv_cache_dtype: str | None = _setting(
        None, "KV pool dtype (default: --dtype); float16/bfloat16 halve its bytes", choices=KV_CACHE_DTYPES
    )
    max_num_seqs: int = _setting(128, "sequences decoded together in one step")
    max_num_batched_tokens: int = _setting(2048, "tokens computed in one step; longer prompts are prefilled in chunks")
    enable_prefix_caching: bool = _setting(True, "reuse the blocks of a common prompt prefix", flag=None)
    attention_backend: str = _setting("auto", "auto | torch | triton: auto takes Triton on CUDA when it imports")
    quantize: str | None = _setting(
        None, "int8: weight-only int8 linears; w8a8: int8 weights and per-token int8 activations", choices=QUANTIZATIONS
    )
    num_threads: int | None = _setting(None, "torch CPU threads (default: torch's, one per core)", flag="--threads")
    compile: bool = _setting(
        False, "compiled steps: faster decoding; compiled once per model shape and mode (minutes), then cached on disk"
    )
    enforce_eager: bool = _setting(
        False, "CUDA: run decode steps eagerly instead of replaying the CUDA graphs captured at start"
    )
    compile_cache_dir: str | None = _setting(
        None, "where compile=True keeps its compiled steps, a folder only this user may write (default: "
        "$MINIGPT_CACHE_DIR or ~/.cache/minigpt/compiled)"
    )
    verify_weights: bool = _setting(
        False, "check the weight files against the SHA-256 the hub published for them (hub checkpoints only)",
        flag="--verify",
    )
    batch_invariant: bool = _setting(
        False, "CPU: a request's tokens and logprobs bitwise the same whatever it is batched with, however its "
        "prompt is chunked or cached, preempted or drafted for, in the float and eager w8a8 modes (costs speed; "
        "the fast mode is invariant without it)"
    )
    overlap: str = _setting(
        "auto", "lay the next decode step out while the device runs this one, its tokens read a step late (auto: "
        "on with CUDA); steps with beams, grammars, penalties, logprobs or speculation are not overlapped",
        choices=OVERLAP_MODES,
    )
    max_waiting: int = _setting(4096, "queued requests beyond which new ones are refused at once")
    # bounds on one request's work, and on a step's
    max_stop_strings: int = _setting(256, "stop strings a request may give")
    max_stop_chars: int = _setting(16384, "characters a request's stop strings may hold in all")
    hung_step_seconds: int = _setting(60, "a step running this long makes the engine unhealthy (a hung rank or device)")
    speculative_config: dict | None = _setting(
        None, 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1} or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} '
        '(no beam search with it yet)'
    )
    tensor_parallel_size: int = _setting(
        1, "processes the model is sharded over by heads (gloo on the CPU, NCCL with one GPU per rank)"
    )

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_waiting",
                     "tensor_parallel_size", "max_stop_strings", "max_stop_chars", "hung_step_seconds"):
            _check_positive(name, getattr(self, name))
        for name in ("kv_cache_tokens", "num_threads"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), " or None")
        for name in ("enable_prefix_caching", "compile", "enforce_eager", "verify_weights", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ParamError.must_be("", name, getattr(self, name), "True or False")
        if self.kv_cache_dtype is not None:
            try:
                resolve_dtype(self.kv_cache_dtype)  # names, or a torch.dtype as `dtype` takes
            except ValueError:
                raise ParamError.must_be("", "kv_cache_dtype", self.kv_cache_dtype,
                                         "None, float32, float16 or bfloat16") from None
        if self.overlap not in OVERLAP_MODES:
            raise ParamError.must_be("", "overlap", self.overlap, f"one of {OVERLAP_MODES}")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ParamError.must_be("", "quantize", self.quantize, f"None or one of {QUANTIZATIONS}")
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)
        self._check_combinations()
        if self.compile:
            check_torch_for("compile", True)
        if self.quantize is not None:
            check_torch_for("quantize", self.quantize)

    def _check_combinations(self) -> None:
        compile, invariant = Named("compile", True), Named("batch_invariant", True)
        if self.compile and self.tensor_parallel_size > 1:
            size = Named("tensor_parallel_size", self.tensor_parallel_size)
            raise ParamError("", "compile", (compile, " with ", size, " is not supported yet: use one or the other"))
        if not self.batch_invariant:
            return
        if self.device != "cpu":
            raise ParamError("", "batch_invariant", (invariant, " is for the CPU, got ", Named("device", self.device)))
        if self.tensor_parallel_size > 1:
            raise ParamError("", "batch_invariant", (invariant, " with tensor_parallel_size > 1 is not supported: use "
                                                                "one or the other"))
        if INVARIANT_KEYS % self.block_size and self.block_size % INVARIANT_KEYS:
            raise ParamError("", "batch_invariant", (invariant, f" needs a block_size that divides {INVARIANT_KEYS} or "
                                                                f"that it divides, got {self.block_size}"))
        if self.compile and self.quantize != "w8a8":  # compiled float linears: not tiled
            raise ParamError("", "batch_invariant", (invariant, " with ", compile, " needs ",
                                                     Named("quantize", "w8a8")))

    @property
    def invariance(self) -> BatchInvariance:
        """How this engine keeps a request's bits independent of its company: the one place that decides it."""
        fast_mode = self.compile and self.quantize == "w8a8" and self.device == "cpu"  # compiled w8a8's steps
        return BatchInvariance(attention=self.batch_invariant,
                               tiled_linears=self.batch_invariant and self.quantize != "w8a8",
                               holds=self.batch_invariant or fast_mode)

    @property
    def overlapped(self) -> bool:
        return self.overlap == "on" or (self.overlap == "auto" and str(self.device).startswith("cuda"))

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
        raise ParamError.must_be("", name, value, f"a positive integer{alternative}")
