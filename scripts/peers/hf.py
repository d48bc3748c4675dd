"""HF transformers' ``GPT2LMHeadModel.generate`` as a peer."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .base import Peer
from .checkpoints import eos_id
from .machine import THREADS
from .results import BatchResult, StreamResult, mean_gap


class HFPeer(Peer):
    """``GPT2LMHeadModel.generate``: one by one, or a static batch padded on the left."""

    name = "transformers"
    dtypes = ("float32", "bfloat16")
    devices = ("cpu", "cuda")

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.eos = 50256

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("transformers") is None:
            return "transformers not installed (pip install transformers)"
        return None

    def prepare(self, checkpoint_dir: str | Path, dtype: str) -> None:
        import torch
        from transformers import GPT2LMHeadModel

        torch.set_num_threads(THREADS)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.eos = eos_id(self.checkpoint_dir)
        self.dtype = dtype
        self.model = GPT2LMHeadModel.from_pretrained(
            self.checkpoint_dir, dtype=getattr(torch, dtype)
        ).eval().to(self.device)
        # Never stop at EOS: every engine generates exactly max_new_tokens.
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = self.eos

    def _gen_kwargs(self, max_new_tokens: int) -> dict[str, Any]:
        return dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=self.eos,
        )

    def run_batch(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int | None = None
    ) -> BatchResult:
        import torch

        def generate(chunk: Sequence[Sequence[int]]) -> list[list[int]]:
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.eos, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):  # left padding: the new tokens line up on the right
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      **self._gen_kwargs(max_new_tokens))
            return out[:, width:].tolist()

        with torch.inference_mode():
            return self.run_static_batches(prompts, max_new_tokens, batch_size, generate)

    def run_stream(self, prompt: Sequence[int], max_new_tokens: int) -> StreamResult:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class _Clock(BaseStreamer):
            """Records when generate hands out each new token (its first put() is the prompt)."""

            def __init__(self) -> None:
                self.times: list[float] = []
                self.seen_prompt = False

            def put(self, value: Any) -> None:
                if not self.seen_prompt:
                    self.seen_prompt = True
                    return
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        clock = _Clock()
        ids = torch.tensor([list(prompt)], device=self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), streamer=clock,
                **self._gen_kwargs(max_new_tokens),
            )
        end = time.perf_counter()
        gen = out[0, len(prompt) :].tolist()
        t = clock.times
        return StreamResult(self.name, self.dtype or "?", len(prompt), len(gen), t[0] - start, mean_gap(t),
                            end - start, gen)

    def close(self) -> None:
        self.model = None
