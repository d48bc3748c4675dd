"""CTranslate2's ``Generator`` as a peer, over a model it converts from the HF checkpoint once (cached)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import Peer
from .checkpoints import checkpoint_cache_dir
from .machine import THREADS
from .results import BatchResult, StreamResult, mean_gap


class CTranslate2Peer(Peer):
    """``ctranslate2.Generator.generate_batch`` (static batches) and ``generate_tokens`` (stream)."""

    name = "ctranslate2"
    dtypes = ("float32", "int8")
    _QUANT = {"float32": "float32", "int8": "int8", "int8_float32": "int8", "bfloat16": "bfloat16"}

    def __init__(self) -> None:
        super().__init__()
        self.generator: Any = None
        self.vocab: list[str] = []

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("ctranslate2") is None:
            return "ctranslate2 not installed (pip install ctranslate2)"
        if importlib.util.find_spec("transformers") is None:
            return "ctranslate2's converter needs transformers (pip install transformers)"
        return None

    def convert(self, checkpoint_dir: str | Path, quantization: str) -> Path:
        """The CTranslate2 model dir for this checkpoint and quantization, converting once."""
        out = checkpoint_cache_dir(checkpoint_dir) / f"ct2-{quantization}"
        if not (out / "model.bin").exists():
            from ctranslate2.converters import TransformersConverter

            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            TransformersConverter(str(checkpoint_dir)).convert(str(tmp), quantization=quantization, force=True)
            tmp.rename(out)
        return out

    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        import ctranslate2

        self.checkpoint_dir = Path(checkpoint_dir)
        self.dtype = dtype
        model_dir = self.convert(checkpoint_dir, self._QUANT[dtype])
        self.vocab = json.loads((model_dir / "vocabulary.json").read_text(encoding="utf-8"))
        self.generator = ctranslate2.Generator(
            str(model_dir), device="cpu", compute_type=dtype, inter_threads=1, intra_threads=THREADS
        )

    def _tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> BatchResult:
        bs = batch_size or len(prompts)

        def generate(chunk: Sequence[Sequence[int]]) -> list[list[int]]:
            res = self.generator.generate_batch(
                [self._tokens(p) for p in chunk],
                max_batch_size=bs,
                beam_size=1,
                sampling_topk=1,
                max_length=max_new_tokens,
                min_length=max_new_tokens,
                end_token=[],  # no end token: generate exactly max_new_tokens
                include_prompt_in_result=False,
            )
            return [r.sequences_ids[0] for r in res]

        return self.run_static_batches(prompts, max_new_tokens, bs, generate)

    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> StreamResult:
        times: list[float] = []
        gen: list[int] = []
        start = time.perf_counter()
        for step in self.generator.generate_tokens(
            self._tokens(prompt), max_length=max_new_tokens, min_length=max_new_tokens,
            sampling_topk=1, end_token=[],
        ):
            times.append(time.perf_counter())
            gen.append(step.token_id)
        end = time.perf_counter()
        return StreamResult(self.name, self.dtype or "?", len(prompt), len(gen), times[0] - start,
                            mean_gap(times), end - start, gen)

    def close(self) -> None:
        self.generator = None
