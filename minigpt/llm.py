"""`LLM`: the engine as a Python API, `generate`, `stream` and `beam_search` over continuously batched requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC

from minigpt.assemble.engine import build_engine
from minigpt.beam.params import BeamSearchOutput, BeamSearchParams
from minigpt.common.errors import ParamError
from minigpt.common.progress import Progress
from minigpt.demo import model_or_demo
from minigpt.engine.config import EngineConfig
from minigpt.engine.request import EngineRequest, Prompt, Request, RequestOutput
from minigpt.sampling import SamplingParams


class LLM:
    """A GPT-2 engine: `model` a hub id or a checkpoint directory (None: the demo model shipped with minigpt),
    `engine_args` EngineConfig's fields."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs("LLM", engine_args)
        self.engine = build_engine(model_or_demo(model, "LLM"), self.config)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.RLock()  # re-entrant: generate() inside a stream() loop must not deadlock
        self._closed = False

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); one output per prompt, in input order. `progress`: a
        progress line on stderr (default: for long batches on a terminal)."""
        prompts = self._as_list(prompts)
        return self._run(prompts, self._params_for(prompts, params), SamplingParams, progress)

    def beam_search(self, prompts: Prompt | list[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search each prompt (text or token ids), all continuously batched; per prompt, in input order,
        its `params.beam_width` hypotheses, best first, as transformers' beam search ranks them."""
        prompts = self._as_list(prompts)
        return self._run(prompts, [params] * len(prompts), BeamSearchParams, False)

    def _run(self, prompts: list[Prompt], params: list, kind: type, progress: bool | None) -> list:
        with self._lock:
            self._check_open()
            requests = [self._make(i, p, sp, kind) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
            bar = Progress(len(requests), enabled=progress)
            for request in requests:
                self.engine.add(request)
            try:
                done = 0
                while not all(r.finished for r in requests):
                    self.engine.step()
                    now_done = sum(r.finished for r in requests)
                    if now_done != done or self.engine.num_steps % 16 == 0:
                        done = now_done
                        bar.update(done, self.engine.num_generated_tokens)
            except BaseException:
                for request in requests:
                    self.engine.abort(request)
                raise
            finally:
                bar.close()
            return [r.output() for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas of one completion as tokens are generated (never the start of a stop string that may
        still match); bad input raises here, before the first delta."""
        self._check_open()
        request = self.engine.make_request(prompt, SamplingParams() if params is None else params, SamplingParams)
        if len(request.seqs) != 1:
            raise ValueError("stream() takes one completion: SamplingParams.n must be 1")
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[str]:
        seq = request.seqs[0]
        with self._lock:
            self._check_open()
            self.engine.add(request)
            try:
                while not seq.finished:
                    self._check_open()  # the caller may have closed the LLM between two deltas
                    self.engine.step()
                    delta = seq.take_text_delta()
                    if delta:
                        yield delta
                tail = seq.take_text_delta()
                if tail:
                    yield tail
            finally:
                self.engine.abort(request)

    def _make(self, index: int, prompt: Prompt, params, kind: type) -> EngineRequest:
        try:
            return self.engine.make_request(prompt, params, kind)
        except ValueError as err:
            where = f"prompt {index}: "
            refused = err.at(where) if isinstance(err, ParamError) else ValueError(where + str(err))
            refused.prompt_index, refused.cause = index, err  # a front end may name the prompt its own way
            raise refused from None

    @staticmethod
    def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
        if isinstance(prompts, (str, bytes, bytearray)):  # one prompt (bytes: one the engine refuses)
            return [prompts]
        if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        if not isinstance(prompts, SequenceABC):
            raise TypeError("prompts must be a string, a list of strings or a list of token-id lists "
                            "(arrays: .tolist())")
        return list(prompts)

    @staticmethod
    def _params_for(prompts: list[Prompt], params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if not isinstance(params, SequenceABC):
            raise TypeError(f"params must be SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return params

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed")

    @property
    def kv_cache_info(self) -> dict[str, int]:
        return self.engine.kv_cache_info()

    def close(self) -> None:
        """Free the KV pool and the compiled steps."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
