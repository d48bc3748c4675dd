"""The engine: requests in, one step at a time: schedule -> run -> postprocess.

The scheduler picks (sequence, tokens) pairs for the step; the model runner lays them out flat and
computes the logits of the rows that are sampled or scored; the sampler picks the tokens; finished
sequences give their pages back.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace

import torch

from minigpt.assemble.runner import build_runner
from minigpt.beam.params import BeamSearchParams
from minigpt.beam.search import BeamGroup, advance_all
from minigpt.common.transfer import to_device
from minigpt.engine.config import EngineConfig
from minigpt.engine.kv_cache import BlockManager
from minigpt.engine.request import Prompt, Request
from minigpt.engine.runner import StepInputs
from minigpt.engine.scheduler import ScheduledBatch, Scheduler
from minigpt.engine.sequence import Sequence
from minigpt.model.config import eos_token_ids
from minigpt.model.weights import check_complete, resolve_checkpoint
from minigpt.model.weights_verify import verify_weights
from minigpt.sampling import GrammarMask, Sampler, SamplingParams, prompt_logprobs
from minigpt.speculative import SpeculativeConfig, Speculator, accept, sampling_rows
from minigpt.structured.grammar import compiler_for, fill_bitmask
from minigpt.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("minigpt")


class Engine:
    """Tokenizer, model runner, scheduler and sampler; `step()` advances every request once."""

    def __init__(self, model: str, config: EngineConfig) -> None:
        self.config = config
        self._threads_before = torch.get_num_threads()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # torch's setting: the whole process's
        path = resolve_checkpoint(model)
        check_complete(path)
        if config.verify_weights:
            verify_weights(path)
        self.tokenizer = Tokenizer.from_dir(path)
        self.runner = build_runner(path, config)
        self.model_config = self.runner.model.config
        self.blocks = BlockManager(self.runner.pool.num_blocks, config.block_size, config.enable_prefix_caching)
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
        self.speculator = None
        if config.speculative_config is not None:
            self.speculator = Speculator(
                SpeculativeConfig.parse(config.speculative_config), config, self.tokenizer, self.vocab_limit,
                self.runner.pool.num_tokens, sum(p.numel() for p in self.runner.model.parameters()), build_runner,
            )
        self._ids = itertools.count()  # next() is atomic: make_request may run in any thread
        self.beam_groups: dict[int, BeamGroup] = {}  # request id -> its beam search
        self.num_steps = 0
        self.num_generated_tokens = 0
        # stats hook: (batch, sequences that sampled, tokens they got)
        self.on_step: Callable[[ScheduledBatch, list[Sequence], int], None] | None = None

    # -- requests -------------------------------------------------------------------------------

    def make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        """Validate and tokenize a prompt; raises ValueError naming the problem."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params = replace(params)  # checked again (a field set after construction) and the request's own copy
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif (isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray))
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            text, ids = None, list(prompt)
        else:
            raise TypeError("a prompt must be a string or a list of token ids as Python ints (arrays: .tolist(), "
                            "bytes: .decode())")
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:  # text too: a tokenizer may know more ids than the model has rows
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_limit})")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= self.vocab_limit]
            if bad:
                raise ValueError(f"SamplingParams.{name} has token id {bad[0]}, outside the vocabulary "
                                 f"[0, {self.vocab_limit})")
        self._check_stop(params.stop)
        held_back = {*params.stop_token_ids, *self.eos_token_ids}  # what min_tokens suppresses
        if params.min_tokens and params.allowed_token_ids and held_back.issuperset(params.allowed_token_ids):
            raise ValueError(
                f"SamplingParams.allowed_token_ids holds only stop or EOS ids, which min_tokens={params.min_tokens} "
                "holds back: no token could be picked"
            )
        limit = self.model_config.n_positions
        if len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} exceeds the model's context "
                f"of {limit} tokens (n_positions)"
            )
        needed = len(ids) + params.max_tokens
        if self.blocks.blocks_needed(needed) > self.blocks.num_blocks:
            raise ValueError(
                f"the KV pool holds {self.runner.pool.num_tokens} tokens but this request needs {needed}; "
                "raise kv_cache_tokens"
            )
        compiler = None
        if params.structured_outputs is not None:
            compiler = compiler_for(self.tokenizer)
            compiler.compile(params.structured_outputs)  # a bad grammar is refused here
        request = Request(next(self._ids), text, ids, params)
        base_seed = params.seed if params.seed is not None else random.getrandbits(62)
        for i in range(params.n):
            seed = (base_seed + i * 0x9E3779B97F4A7C15) & (2**63 - 1)
            grammar = compiler.matcher(params.structured_outputs, params.max_tokens) if compiler is not None else None
            request.seqs.append(
                Sequence(request.request_id, ids, params, seed, self.tokenizer, self.eos_token_ids, limit, grammar)
            )
        return request

    def _check_stop(self, stop: tuple[str, ...]) -> None:
        config = self.config
        if len(stop) > config.max_stop_strings:
            raise ValueError(f"SamplingParams.stop has {len(stop)} strings; this engine takes at most "
                             f"{config.max_stop_strings} (max_stop_strings)")
        chars = sum(map(len, stop))
        if chars > config.max_stop_chars:
            raise ValueError(f"SamplingParams.stop holds {chars} characters; this engine takes at most "
                             f"{config.max_stop_chars} in all (max_stop_chars)")

    def make_beam_request(self, prompt: Prompt, params: BeamSearchParams) -> BeamGroup:
        """Validate and tokenize a beam-search prompt; raises ValueError naming the problem."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if self.speculator is not None:
            raise ValueError("beam search does not run with speculative_config yet: start the engine without it")
        params = replace(params)
        # each beam runs as a sequence that never stops by itself: the group decides where beams end
        request = self.make_request(prompt, SamplingParams(max_tokens=params.max_tokens, ignore_eos=True))
        group = BeamGroup(request, params, self.eos_token_ids, self.tokenizer)
        per_beam = group.num_candidates // params.beam_width
        if group.num_candidates > self.vocab_limit:  # each step ranks num_candidates tokens of every beam
            raise ValueError(f"BeamSearchParams.beam_width must be at most {self.vocab_limit // per_beam} (a step "
                             f"ranks {per_beam} x beam_width of the {self.vocab_limit} tokens), "
                             f"got {params.beam_width}")
        return group

    def add(self, request: Request | BeamGroup) -> None:
        if isinstance(request, BeamGroup):
            self.beam_groups[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def abort(self, request: Request | BeamGroup, error: str | None = None) -> None:
        """Stop a request now and return its pages; with `error`, it fails with that message."""
        self.beam_groups.pop(request.request_id, None)
        for seq in request.seqs:
            if not seq.finished and error is None:
                seq.abort()
            elif not seq.finished:
                seq.fail(error)
            self._finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def kv_cache_info(self) -> dict[str, int]:
        """Pool size and use: blocks, tokens, bytes."""
        pool = self.runner.pool
        return {"num_blocks": self.blocks.num_blocks, "block_size": self.blocks.block_size,
                "num_tokens": pool.num_tokens, "nbytes": pool.nbytes, "blocks_in_use": self.blocks.num_used}

    def num_running_requests(self) -> int:
        return len({seq.request_id for seq in self.scheduler.running})

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that got a token this step, or finished scoring their prompt
        (max_tokens=0). If the step fails, its sequences fail (finish_reason "error", their pages freed)
        and the error is raised."""
        batch = self.scheduler.schedule()
        if not batch.chunks:
            if self.scheduler.has_work():
                raise RuntimeError("no request fits in the KV pool; raise kv_cache_tokens")
            return []
        try:
            self.runner.copy_blocks(batch.copies)
            if self.speculator is not None:
                batch.chunks = self.speculator.draft(batch.chunks, self.blocks, self.scheduler.max_num_batched_tokens)
            inputs = self.runner.prepare(batch.chunks)
            generated = sum(len(seq.output_token_ids) for seq in inputs.sample_seqs)
            updated = self._postprocess(batch, inputs, self.runner.run(inputs))
        except Exception as err:
            self._fail(batch, err)
            raise
        sampled = inputs.sample_seqs
        num_tokens = sum(len(seq.output_token_ids) for seq in sampled) - generated
        self.num_steps += 1
        self.num_generated_tokens += num_tokens
        if self.on_step is not None:
            self.on_step(batch, sampled, num_tokens)
        return updated

    def _fail(self, batch: ScheduledBatch, err: Exception) -> None:
        error = f"{type(err).__name__}: {err}"
        for seq, _ in batch.chunks:
            if not seq.finished:
                seq.fail(error)
            self._finish(seq)
        for request_id in {seq.request_id for seq, _ in batch.chunks} & self.beam_groups.keys():
            self.abort(self.beam_groups[request_id], error)  # its beams that were not in this step

    def _postprocess(self, batch: ScheduledBatch, inputs: StepInputs, logits: torch.Tensor) -> list[Sequence]:
        """Account the computed tokens, record prompt logprobs, sample and append; returns the sequences that
        finished scoring or sampled."""
        for seq, chunk in batch.chunks:
            seq.num_computed_tokens += chunk - len(seq.draft_token_ids)  # drafts count once verified
            self.blocks.register_full_blocks(seq)
        for seq, row, positions in inputs.prompt_logprob_rows:
            targets = [seq.prompt_token_ids[p + 1] for p in positions]
            rows = logits[row : row + len(positions)]
            seq.prompt_logprobs.extend(prompt_logprobs(rows, targets, seq.params.prompt_logprobs, self.vocab_limit))
        scored = [seq for seq, _ in batch.chunks if seq.scores_only and not seq.num_uncomputed_tokens]
        for seq in scored:
            seq.finish_scoring()
            self._finish(seq)
        sampled = inputs.sample_seqs
        if not sampled:
            return scored
        rows = inputs.sample_rows
        # beams and speculation never meet (make_beam_request): with beams, one row per sequence
        beam_rows = [i for i, seq in enumerate(sampled) if seq.request_id in self.beam_groups]
        if beam_rows:
            self._advance_beams([sampled[i] for i in beam_rows], logits[self._rows([rows[i] for i in beam_rows])])
            beams = set(beam_rows)
            rows = [row for i, row in enumerate(rows) if i not in beams]
            decoded = [seq for i, seq in enumerate(sampled) if i not in beams]
        else:
            decoded = sampled
        if not decoded:
            return scored + sampled
        if len(rows) != logits.shape[0]:  # logits also hold prompt positions or beams: keep the sampled rows
            logits = logits[self._rows(rows)]
        sampling = sampling_rows(decoded)
        out = self.sampler(logits, sampling, self._grammar_mask(sampling))
        logprobs = out.logprobs or [None] * len(out.token_ids)
        row = 0
        for seq in decoded:
            num_drafts = len(seq.draft_token_ids)
            rows = slice(row, row + num_drafts + 1)
            row = rows.stop
            if not num_drafts:
                seq.append(out.token_ids[rows.start], logprobs[rows.start])
            else:
                self._verified(seq, accept(seq, out.token_ids[rows], logprobs[rows]))
            if seq.finished:
                self._finish(seq)
        return scored + sampled

    @staticmethod
    def _grammar_mask(sampled: list[Sequence]) -> GrammarMask | None:
        """The tokens each structured-output sequence's grammar allows next, or None when none has one."""
        rows = [i for i, seq in enumerate(sampled) if seq.grammar is not None]
        if not rows:
            return None
        left = [sampled[i].max_len - len(sampled[i].token_ids) for i in rows]
        return GrammarMask(rows, fill_bitmask([sampled[i].grammar for i in rows], left))

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return to_device(rows, torch.int64, self.runner.device)

    def _advance_beams(self, beams: list[Sequence], logits: torch.Tensor) -> None:
        """Hand each beam its best next tokens (fp32 log_softmax over the model's whole vocabulary, as
        transformers takes it, ids past the tokenizer's excluded); advance the groups that have all theirs."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        logprobs[:, self.vocab_limit :] = -torch.inf
        groups = [self.beam_groups[beam.request_id] for beam in beams]
        best, ids = logprobs.topk(max(group.num_candidates for group in groups), dim=-1)
        ready = []
        for beam, group, row_best, row_ids in zip(beams, groups, best.cpu(), ids.cpu(), strict=True):
            if group.receive(beam, row_best, row_ids) and group not in ready:
                ready.append(group)
        advance_all(ready, self.scheduler)
        for group in ready:
            if group.done:
                del self.beam_groups[group.request_id]

    def _verified(self, seq: Sequence, num_accepted: int) -> None:
        """Keep the K/V of the accepted drafts, roll the rejected ones back and return the pages past the need."""
        self.speculator.record(seq, len(seq.draft_token_ids), num_accepted)
        seq.draft_token_ids = []
        if seq.finished:
            return
        seq.num_computed_tokens = len(seq.token_ids) - 1  # the last token's K/V is computed next step
        self.blocks.register_full_blocks(seq)
        self.blocks.shrink(seq.block_table, len(seq.token_ids))

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def close(self) -> None:
        """Free the KV pool and the compiled steps."""
        self.runner.close()
        if self.speculator is not None:
            self.speculator.close()
        if self.config.num_threads is not None and torch.get_num_threads() == self.config.num_threads:
            torch.set_num_threads(self._threads_before)  # unless someone has set it since
