"""The step loop (`Engine`) and the public `LLM` API on top of it.

One step: the scheduler picks (sequence, tokens) pairs; the engine lays them out as one flat
batch (prompt chunks first, then one token per decoding sequence) with positions, the slot of
each token in the KV pool and the pages each query reads; the model computes logits only where
a token is sampled; the sampler picks the tokens; finished sequences give their pages back.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, replace

import torch

from minigpt.attention import PrefillSegment, StepMetadata, select_backend
from minigpt.config import eos_token_ids
from minigpt.cpu_linear import prepare_linears
from minigpt.decode_graph import PREFILL_MAX_TOKENS, DecodeGraph
from minigpt.engine_config import EngineConfig
from minigpt.kv_cache import BlockManager, KVPool, bytes_per_token
from minigpt.model import load_model
from minigpt.progress import Progress
from minigpt.sampling import Sampler, SamplingParams, TokenLogprobs, prompt_logprobs
from minigpt.scheduler import ScheduledBatch, Scheduler
from minigpt.sequence import Sequence
from minigpt.tokenizer import Tokenizer
from minigpt.transfer import to_device
from minigpt.weights import check_complete, resolve_checkpoint, resolve_device, resolve_dtype

logger = logging.getLogger("minigpt")

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" (| "abort" | "error" from the concurrent front)
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    """Seconds: time in the queue, to the first token, and per output token after it."""

    queue_time: float
    time_to_first_token: float
    time_per_output_token: float
    num_preemptions: int


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt. `token_ids`, `text`, `finish_reason` and `logprobs` are
    the first completion's (the only one unless SamplingParams.n > 1; all n are in `outputs`)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = True

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


@dataclass
class Request:
    """A prompt and its n sequences."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.seqs)

    def output(self) -> RequestOutput:
        first = self.seqs[0]
        t = first.timings
        scheduled = t.first_scheduled if t.first_scheduled is not None else t.arrival
        first_token = t.first_token if t.first_token is not None else scheduled
        end = t.finished if t.finished is not None else time.perf_counter()
        n_out = len(first.output_token_ids)
        metrics = RequestMetrics(
            queue_time=scheduled - t.arrival,
            time_to_first_token=first_token - t.arrival,
            time_per_output_token=(end - first_token) / (n_out - 1) if n_out > 1 else 0.0,
            num_preemptions=sum(s.num_preemptions for s in self.seqs),
        )
        outputs = [
            CompletionOutput(i, list(s.output_token_ids), s.text, s.finish_reason, s.logprobs)
            for i, s in enumerate(self.seqs)
        ]
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, outputs, metrics, first.prompt_logprobs, self.finished
        )


class Engine:
    """Model, tokenizer, KV pool, scheduler and sampler; `step()` advances every request once."""

    def __init__(self, model: str, config: EngineConfig) -> None:
        self.config = config
        self._threads_before = torch.get_num_threads()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # torch's setting: the whole process's
        dtype, device = resolve_dtype(config.dtype), resolve_device(config.device)
        path = resolve_checkpoint(model)
        check_complete(path)
        self.tokenizer = Tokenizer.from_dir(path)
        self.model = load_model(path, dtype=dtype, device=device)
        if config.quantize is not None:
            from minigpt.quantize import quantize

            quantize(self.model, config.quantize)
        else:
            prepare_linears(self.model, dtype, device)
        self.model_config = self.model.config
        self.device = device
        self.backend = select_backend(config.attention_backend, device)
        kv_dtype = resolve_dtype(config.kv_cache_dtype or config.dtype)
        bs = config.block_size
        if config.kv_cache_tokens:
            num_tokens = config.kv_cache_tokens
            num_blocks = num_tokens // bs
        else:  # from the memory budget, capped at max_num_seqs full contexts of whole pages each
            num_tokens = config.kv_cache_memory // bytes_per_token(self.model_config, kv_dtype)
            num_blocks = min(num_tokens // bs, config.max_num_seqs * -(-self.model_config.n_positions // bs))
        if num_blocks < 1:
            raise ValueError(f"KV pool of {num_tokens} tokens holds no block of {bs} tokens")
        self.pool = KVPool(self.model_config, num_blocks, bs, kv_dtype, device)
        self.decode_graph = None
        if config.compile:
            from minigpt.quantize import compile_options

            self.decode_graph = DecodeGraph(self.model, self.pool, compile_options(config.quantize, device))
        self.blocks = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos_token_ids = eos_token_ids(path, self.model_config)
        # Ids a token can have: a checkpoint's embedding may be padded past the tokenizer (50304 rows)
        self.vocab_limit = min(self.tokenizer.n_vocab, self.model_config.vocab_size)
        unreachable = [i for i in self.eos_token_ids if i >= self.vocab_limit]
        if unreachable:
            logger.warning(
                "EOS id %s is past the %d ids the tokenizer and the model share: generation never stops on it "
                "(is a tokenizer file that adds it missing from %s?)", unreachable[0], self.vocab_limit, path,
            )
        self.sampler = Sampler(self.vocab_limit, self.eos_token_ids)
        self._ids = itertools.count()  # next() is atomic: make_request may run in any thread
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.on_step: Callable[[ScheduledBatch, list[Sequence]], None] | None = None  # stats hook
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)", num_blocks, config.block_size,
            self.pool.num_tokens, self.pool.nbytes / 2**20, str(kv_dtype).removeprefix("torch."),
        )
        if self.decode_graph is not None:
            self.decode_graph.warmup()

    # -- requests -------------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        """Validate and tokenize a prompt; raises ValueError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params = replace(params)  # checked again (a field set after construction) and the request's own copy
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, SequenceABC) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise TypeError("a prompt must be a string or a list of token ids as Python ints (arrays: .tolist())")
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:  # text too: a tokenizer may know more ids than the model has rows
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_limit})")
        limit = self.model_config.n_positions
        if len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} exceeds the model's context "
                f"of {limit} tokens (n_positions)"
            )
        needed = len(ids) + params.max_tokens
        if self.blocks.blocks_needed(needed) > self.blocks.num_blocks:
            raise ValueError(
                f"the KV pool holds {self.pool.num_tokens} tokens but this request needs {needed}; "
                "raise kv_cache_tokens"
            )
        request = Request(next(self._ids), text, ids, params)
        base_seed = params.seed if params.seed is not None else random.getrandbits(62)
        for i in range(params.n):
            seed = (base_seed + i * 0x9E3779B97F4A7C15) & (2**63 - 1)
            request.seqs.append(
                Sequence(request.request_id, ids, params, seed, self.tokenizer, self.eos_token_ids, limit)
            )
        return request

    def add(self, request: Request) -> None:
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort(self, request: Request) -> None:
        """Stop a request now and return its pages."""
        for seq in request.seqs:
            if not seq.finished:
                seq.abort()
            self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that got a token this step."""
        batch = self.scheduler.schedule()
        if not batch.chunks:
            if self.scheduler.has_work():
                raise RuntimeError("no request fits in the KV pool; raise kv_cache_tokens")
            return []
        scheduled = time.perf_counter()
        for seq, _ in batch.chunks:
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = scheduled
        inputs = self._prepare(batch.chunks)
        try:
            logits = self._forward(inputs)
        except Exception as err:
            for seq, _ in batch.chunks:
                seq.fail(f"{type(err).__name__}: {err}")
                self.scheduler.finish(seq)
            raise
        for seq, chunk in batch.chunks:
            seq.num_computed_tokens += chunk
            self.blocks.register_full_blocks(seq)
        for seq, row, positions in inputs.prompt_logprob_rows:
            self._record_prompt_logprobs(seq, logits[row : row + len(positions)], positions)
        sampled = inputs.sample_seqs
        if sampled:
            if inputs.prompt_logprob_rows:  # logits also hold prompt positions: keep the sampled rows
                logits = logits[to_device(inputs.sample_rows, torch.int64, self.device)]
            out = self.sampler(logits, sampled)
            logprobs = out.logprobs or [None] * len(sampled)
            for seq, token, lp in zip(sampled, out.token_ids, logprobs, strict=True):
                seq.append(token, lp)
                if seq.finished:
                    self.scheduler.finish(seq)
        self.num_steps += 1
        self.num_generated_tokens += len(sampled)
        if self.on_step is not None:
            self.on_step(batch, sampled)
        return sampled

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        meta, graph = inputs.meta, self.decode_graph
        if graph is not None and not meta.prefills:  # decode only: one logits row per sequence
            return graph(
                inputs.input_ids, inputs.positions, meta.decode_block_tables, meta.decode_context_lens,
                meta.slot_mapping,
            )
        if graph is not None and self._is_lone_whole_prompt(inputs):
            return graph.prefill(inputs.input_ids, inputs.positions, meta.slot_mapping)
        backend, around = self.backend, {}
        if graph is not None:
            around = {"around_attention": graph.around_attention}
            if backend.name == "torch":  # the decodes among prompts read their pages in place, compiled
                backend = graph.decode_backend
        return self.model.forward_step(
            inputs.input_ids, inputs.positions, self.pool.kv, meta, backend, inputs.logits_indices, **around
        )

    @staticmethod
    def _is_lone_whole_prompt(inputs: StepInputs) -> bool:
        """One sequence's whole prompt (2 to PREFILL_MAX_TOKENS tokens) with nothing cached, sampling its
        last token only."""
        meta = inputs.meta
        if len(meta.prefills) != 1 or meta.decode_block_tables is not None or inputs.prompt_logprob_rows:
            return False
        segment = meta.prefills[0]
        whole = segment.context_len == segment.length
        return whole and 2 <= segment.length <= PREFILL_MAX_TOKENS and len(inputs.sample_seqs) == 1

    def _prepare(self, chunks: list[tuple[Sequence, int]]) -> StepInputs:
        bs = self.config.block_size
        # A decode is the one token left after a computed context; a single token of a prompt still
        # being computed (chunked prefill, a prefix-cache hit) is a prefill chunk like any other.
        prefills: list[tuple[Sequence, int]] = []
        decodes: list[Sequence] = []
        for seq, chunk in chunks:
            if chunk == seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens > 0:
                decodes.append(seq)
            else:
                prefills.append((seq, chunk))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[PrefillSegment] = []
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[Sequence, int, list[int]]] = []
        for seq, chunk in prefills:
            start, first = len(ids), seq.num_computed_tokens
            end = first + chunk
            table = seq.block_table
            ids.extend(seq.token_ids[first:end])
            positions.extend(range(first, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(first, end))
            pages = to_device(table[: -(-end // bs)], torch.int64, self.device)
            segments.append(PrefillSegment(start, chunk, end, pages))
            if seq.prompt_logprobs is not None:  # positions whose next prompt token is not scored yet
                wanted = [p for p in range(first, end) if len(seq.prompt_logprobs) <= p + 1 < len(seq.prompt_token_ids)]
                if wanted:
                    prompt_rows.append((seq, len(logits_indices), wanted))
                    logits_indices.extend(start + p - first for p in wanted)
            if end == len(seq.token_ids):
                sample_rows.append(len(logits_indices))
                logits_indices.append(start + chunk - 1)
                sample_seqs.append(seq)
        decode_tables = decode_lens = None
        if decodes:
            width = max(len(s.block_table) for s in decodes)
            tables = []
            for seq in decodes:
                p = len(seq.token_ids) - 1
                ids.append(seq.token_ids[-1])
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                sample_rows.append(len(logits_indices))
                logits_indices.append(len(ids) - 1)
                sample_seqs.append(seq)
                tables.append(seq.block_table + [0] * (width - len(seq.block_table)))
            decode_tables = to_device(tables, torch.int32, self.device)
            decode_lens = to_device([len(s.token_ids) for s in decodes], torch.int32, self.device)
        num_prefill_tokens = len(ids) - len(decodes)

        def tensor(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, self.device)

        meta = StepMetadata(tensor(slots), segments, num_prefill_tokens, decode_tables, decode_lens)
        return StepInputs(
            tensor(ids), tensor(positions), meta, tensor(logits_indices), sample_seqs, sample_rows, prompt_rows
        )

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, positions: list[int]) -> None:
        targets = [seq.prompt_token_ids[p + 1] for p in positions]
        seq.prompt_logprobs.extend(
            prompt_logprobs(logits, targets, seq.params.prompt_logprobs, vocab_limit=self.sampler.vocab_limit)
        )

    def close(self) -> None:
        """Free the KV pool and the compiled steps (a frozen graph holds its own copies of the weights)."""
        self.pool.kv = torch.empty(0)
        self.backend.close()
        self.decode_graph = None
        if self.config.num_threads is not None and torch.get_num_threads() == self.config.num_threads:
            torch.set_num_threads(self._threads_before)  # unless someone has set it since


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: StepMetadata
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]
    sample_rows: list[int]
    prompt_logprob_rows: list[tuple[Sequence, int, list[int]]]


class LLM:
    """A GPT-2 engine: load once, then `generate` many prompts, continuously batched.

        with LLM("gpt2") as llm:
            outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

    `model` is a hub id or a local checkpoint directory; the other arguments are the fields
    of `EngineConfig` (documented there, with their defaults).
    """

    def __init__(self, model: str, **engine_args) -> None:
        self.config = EngineConfig.from_kwargs("LLM", engine_args)
        self.engine = Engine(model, self.config)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.RLock()  # re-entrant: generate() inside a stream() loop must not deadlock
        self._closed = False

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); one output per prompt, in input order.

        A progress line goes to stderr for long batches when stderr is a terminal (or when
        `progress=True`; `False` turns it off)."""
        prompts = self._as_list(prompts)
        param_list = self._params_for(prompts, params)
        with self._lock:
            self._check_open()
            requests = [self._make(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, param_list, strict=True))]
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
        """Yield text deltas of one completion as tokens are generated; never half a character,
        never the start of a stop string that may still match. The deltas join to the final text.
        Bad input raises here, before the first delta."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() takes one completion: SamplingParams.n must be 1")
        self._check_open()
        request = self.engine.make_request(prompt, params)
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

    def _make(self, index: int, prompt: Prompt, params: SamplingParams) -> Request:
        try:
            return self.engine.make_request(prompt, params)
        except ValueError as err:
            raise ValueError(f"prompt {index}: {err}") from None

    @staticmethod
    def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
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
        """Pool size and use: blocks, tokens, bytes."""
        blocks = self.engine.blocks
        return {
            "num_blocks": blocks.num_blocks,
            "block_size": blocks.block_size,
            "num_tokens": self.engine.pool.num_tokens,
            "nbytes": self.engine.pool.nbytes,
            "blocks_in_use": blocks.num_used,
        }

    def close(self) -> None:
        """Free the KV pool and the compiled steps. The LLM cannot be used afterwards."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
