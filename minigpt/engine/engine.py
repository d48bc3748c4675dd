"""The engine: requests in, one step at a time: schedule -> run -> postprocess."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch

from minigpt.common.transfer import HostCopy, to_device
from minigpt.engine.config import EngineConfig
from minigpt.engine.input_processor import InputProcessor
from minigpt.engine.kv_cache import BlockManager
from minigpt.engine.request import EngineRequest, Prompt
from minigpt.engine.runner import Ahead, ModelRunner
from minigpt.engine.scheduler import ScheduledBatch, Scheduler
from minigpt.engine.seams import Postprocessor, Speculation, Step
from minigpt.engine.sequence import FINISHED, Sequence
from minigpt.sampling import Sampler, prompt_logprobs
from minigpt.sampling.params import penalised
from minigpt.tokenizer.tokenizer import Tokenizer


class Engine:
    """Tokenizer, model runner, scheduler and sampler; `step()` advances every request once. Features plug in
    (minigpt/assemble/engine.py): request kinds into `inputs`, postprocess `steps`, a `speculator`."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, runner: ModelRunner,
                 eos_token_ids: tuple[int, ...], threads_before: int) -> None:
        self.config, self.tokenizer, self.runner = config, tokenizer, runner
        self._threads_before = threads_before
        self.model_config = runner.model.config
        self.blocks = BlockManager(runner.pool.num_blocks, config.block_size, config.enable_prefix_caching,
                                   generated_apart=runner.forward_path.generated_apart)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos_token_ids = eos_token_ids
        # a checkpoint's embedding may be padded past the tokenizer
        self.vocab_limit = min(tokenizer.n_vocab, self.model_config.vocab_size)
        self.sampler = Sampler(self.vocab_limit, eos_token_ids)
        self.inputs = InputProcessor(config, tokenizer, self.vocab_limit, eos_token_ids,
                                     self.model_config.n_positions, self.blocks, runner.pool.num_tokens)
        self.postprocessors: list[Postprocessor] = []  # features' hooks over a step's logits, run before sampling
        self.speculator: Speculation | None = None
        self.requests: dict[int, EngineRequest] = {}  # added and not yet finished
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._ahead: Step | None = None  # launched by the last step, its tokens drawn and not read (overlap)
        self.on_step: Callable[[ScheduledBatch, list[Sequence], int], None] | None = None

    def make_request(self, prompt: Prompt, params: Any, kind: type | None = None) -> EngineRequest:
        """The request of the kind `params` names (`kind`: the only params type taken)."""
        return self.inputs.make_request(prompt, params, kind)

    def add(self, request: EngineRequest) -> None:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort(self, request: EngineRequest, error: str | None = None) -> None:
        """Stop a request now and return its blocks; with `error`, it fails with that message."""
        self.requests.pop(request.request_id, None)
        for seq in request.seqs:
            if not seq.finished and error is None:
                seq.abort()
            elif not seq.finished:
                seq.fail(error)
            self.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def kv_cache_info(self) -> dict[str, int]:
        pool = self.runner.pool
        return {"num_blocks": self.blocks.num_blocks, "block_size": self.blocks.block_size,
                "num_tokens": pool.num_tokens, "nbytes": pool.nbytes, "blocks_in_use": self.blocks.num_used}

    def num_running_requests(self) -> int:
        return len({seq.request_id for seq in self.scheduler.running})

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that got a token or finished scoring their prompt. A step
        that raises fails its requests (finish_reason "error") and raises. Overlapped, a step whose tokens are
        drawn on the device launches the next before it reads them (`config.overlap`)."""
        step, self._ahead = self._ahead, None
        if step is None:
            batch = self.scheduler.schedule()
            if not batch.num_seqs:
                if self.scheduler.has_work():
                    raise RuntimeError("no request fits in the KV pool; raise kv_cache_tokens")
                return []
            step = self._guarded(batch, self._run, batch)
        if step.drawn is not None:
            following = self.scheduler.schedule_ahead(step.seqs)
            if following is not None:
                self._ahead = self._guarded(following, self._run, following, step)
        self._guarded(step.batch, self._postprocess, step)
        self._retire(step)
        return step.updated

    def _guarded(self, batch: ScheduledBatch, work: Callable, *args: Any) -> Any:
        try:
            return work(*args)
        except Exception as err:
            self._ahead = None
            self._fail(batch, err)
            raise

    def _run(self, batch: ScheduledBatch, before: Step | None = None) -> Step:
        """Launch the batch; `before`: the step whose drawn tokens it decodes."""
        self.runner.copy_blocks(batch.copies)
        if self.speculator is not None:
            self.speculator.draft(batch, self.scheduler.max_num_batched_tokens)
        ahead = None if before is None else Ahead(before.drawn.tensor, before.seqs)
        inputs = self.runner.prepare(batch.chunks, batch.decodes, ahead)
        step = Step(batch, inputs, self.runner.run(inputs), list(inputs.sample_seqs), list(inputs.sample_rows))
        if self.config.overlapped and self._draws_ahead(step):
            step.drawn = HostCopy(self.sampler.draw(self._sampled_logits(step), step.seqs, int(before is not None)))
        return step

    def _draws_ahead(self, step: Step) -> bool:
        """Whether the step's tokens can be drawn on the device before it is postprocessed: one row a sequence,
        each sampled, no feature acting on it, nothing the sampler needs them read for."""
        inputs = step.inputs
        return (self.speculator is None and not inputs.prompt_logprob_rows
                and len(step.seqs) == step.batch.num_seqs == len(step.rows)
                and all(seq.params.logprobs is None and not penalised(seq.params) for seq in step.seqs)
                and not any(feature.acts_on(step) for feature in self.postprocessors))

    def _postprocess(self, step: Step) -> None:
        if step.drawn is not None:
            self._append_drawn(step)
            return
        sampled = step.inputs.sample_seqs
        self._account_computed(step)
        self._record_prompt_logprobs(step)
        self._finish_scoring(step)
        features = [feature for feature in self.postprocessors if feature.acts_on(step)]
        counted = bool(features) or self.speculator is not None  # else: each sampled sequence took one token
        outputs_before = _num_outputs(sampled) if counted else 0
        for feature in features:
            feature(step)
        tokens = self._sample(step)
        step.updated += sampled
        if counted:
            step.num_tokens = _num_outputs(sampled) - outputs_before
            return
        step.num_tokens = len(sampled)
        if len(sampled) == step.batch.num_seqs:
            self.scheduler.took_one_token_each(step.batch)
            if tokens is not None:
                self.runner.took_tokens(tokens)

    def _append_drawn(self, step: Step) -> None:
        """The drawn tokens read and appended, but for the sequences that finished (or were aborted) after the
        step was launched on their last token: theirs was computed for nothing."""
        tokens = step.drawn.tolist()
        batch = step.batch
        batch.chunks = [(seq, chunk) for seq, chunk in batch.chunks if not seq.finished]
        batch.decodes = [seq for seq in batch.decodes if not seq.finished]
        self._account_computed(step)
        live = [(seq, token) for seq, token in zip(step.seqs, tokens, strict=True) if not seq.finished]
        seqs = [seq for seq, _ in live]
        self._append_each(seqs, [token for _, token in live], [None] * len(live))
        step.inputs.sample_seqs = step.updated = seqs
        step.num_tokens = len(live)

    def _fail(self, batch: ScheduledBatch, err: Exception) -> None:
        error = f"{type(err).__name__}: {err}"
        seqs = batch.seqs
        for seq in seqs:
            if not seq.finished:
                seq.fail(error)
            self.finish(seq)
        for request_id in {seq.request_id for seq in seqs}:
            request = self.requests.get(request_id)
            if request is not None and request.finished:
                self.abort(request, error)  # what it still runs outside this step (a beam search's other beams)

    def _retire(self, step: Step) -> None:
        """Forget the step's finished requests; count the step."""
        for request_id in {seq.request_id for seq in step.updated if seq.status is FINISHED}:
            request = self.requests.get(request_id)
            if request is not None and request.finished:
                del self.requests[request_id]
        self.num_steps += 1
        self.num_generated_tokens += step.num_tokens
        if self.on_step is not None:
            self.on_step(step.batch, step.inputs.sample_seqs, step.num_tokens)

    def _account_computed(self, step: Step) -> None:
        full = self.blocks.block_size if self.blocks.enable_prefix_caching else None
        for seq, chunk in step.batch.chunks:
            seq.num_computed_tokens += chunk - len(seq.draft_token_ids)  # drafts count once verified
            if full is not None and seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * full:
                self.blocks.register_full_blocks(seq)
        for seq in step.batch.decodes:
            seq.num_computed_tokens += 1
            if full is not None and seq.num_computed_tokens >= (seq.num_hashed_blocks + 1) * full:
                self.blocks.register_full_blocks(seq)

    def _record_prompt_logprobs(self, step: Step) -> None:
        for seq, row, positions in step.inputs.prompt_logprob_rows:
            targets = [seq.prompt_token_ids[p + 1] for p in positions]
            rows = step.logits[row : row + len(positions)]
            seq.prompt_logprobs.extend(prompt_logprobs(rows, targets, seq.params.prompt_logprobs, self.vocab_limit))

    def _finish_scoring(self, step: Step) -> None:
        for seq in step.inputs.prefill_seqs:  # a scoring request never decodes
            if seq.scores_only and not seq.num_uncomputed_tokens:
                seq.finish_scoring()
                self.finish(seq)
                step.updated.append(seq)

    def _sampled_logits(self, step: Step) -> torch.Tensor:
        if len(step.rows) != step.logits.shape[0]:  # logits also hold prompt positions or beams: the sampled rows
            return step.logits[self.device_rows(step.rows)]
        return step.logits

    def _sample(self, step: Step) -> torch.Tensor | None:
        """The tokens on the device, when each sequence took one."""
        if not step.seqs:
            return None
        spec = self.speculator
        out = self.sampler(self._sampled_logits(step), spec.sampling_rows(step.seqs) if spec else step.seqs)
        tokens, logprobs = out.token_ids, out.logprobs or [None] * len(out.token_ids)
        if len(tokens) == len(step.seqs):  # a row a sequence
            self._append_each(step.seqs, tokens, logprobs)
            return out.tokens
        for seq, rows in step.spans():
            if rows.stop - rows.start == 1:
                seq.append(tokens[rows.start], logprobs[rows.start])
            else:
                spec.verify(seq, tokens[rows], logprobs[rows])
            if seq.finished:
                self.finish(seq)
        return None

    def _append_each(self, seqs: list[Sequence], tokens: list[int], logprobs: list) -> None:
        for seq, token, token_logprobs in zip(seqs, tokens, logprobs, strict=True):
            seq.append(token, token_logprobs)
            if seq.status is FINISHED:
                self.finish(seq)

    def device_rows(self, rows: list[int]) -> torch.Tensor:
        return to_device(rows, torch.int64, self.runner.device)

    def finish(self, seq: Sequence) -> None:
        """Give a finished sequence's blocks back; a feature that appends tokens itself calls it."""
        self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def close(self) -> None:
        """Free the KV pool and the compiled steps."""
        self._ahead = None
        self.runner.close()
        if self.speculator is not None:
            self.speculator.close()
        self.give_back_threads()

    def give_back_threads(self) -> None:
        """torch's thread count as it was before `num_threads`, in the calling thread (OpenMP keeps it per thread),
        unless someone has set it since."""
        if self.config.num_threads is not None and torch.get_num_threads() == self.config.num_threads:
            torch.set_num_threads(self._threads_before)


def _num_outputs(seqs: list[Sequence]) -> int:
    return sum(map(len, map(attrgetter("output_token_ids"), seqs)))
