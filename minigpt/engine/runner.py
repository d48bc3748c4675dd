"""The model runner: `prepare` lays a scheduled batch out as one flat step; `run` computes its logits rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from itertools import repeat
from operator import add, attrgetter, itemgetter, sub
from typing import Protocol

import torch

from minigpt.common.transfer import to_device
from minigpt.engine.config import EngineConfig
from minigpt.engine.decode_rows import DecodeRows
from minigpt.engine.kv_cache import KVPool, bytes_per_token
from minigpt.engine.sequence import Sequence
from minigpt.model.attention import InvariantAttention, PagedAttention, PrefillSegment, StepMetadata
from minigpt.model.backends import select_backend
from minigpt.model.config import GPT2Config
from minigpt.model.gpt2 import GPT2
from minigpt.model.weights import resolve_device, resolve_dtype

logger = logging.getLogger("minigpt")
MAX_BATCHED_PREFILL = 4096  # tokens of prompts attending in one call: its mask holds the square of this


def num_sample_rows(seq: Sequence) -> int:
    """The logits rows a sampled sequence's step draws from: its next token's, and one per draft it verifies."""
    return 1 + len(seq.draft_token_ids)


@dataclass
class Ahead:
    """Tokens a step has drawn and not read yet, that the next step decodes: `tokens[i]` is `seqs[i]`'s."""

    tokens: torch.Tensor  # [R] int64, on the device
    seqs: list[Sequence]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    meta: StepMetadata
    logits_indices: torch.Tensor  # [R] int64: the rows whose logits are computed
    sample_seqs: list[Sequence]
    sample_rows: list[int]  # their rows among the R: `num_sample_rows` each
    # (sequence, its first row among the R, the prompt positions whose next token it scores)
    prompt_logprob_rows: list[tuple[Sequence, int, list[int]]]
    prefill_seqs: list[Sequence]  # those computing prompt (or drafted) tokens


@dataclass
class _Decoded:
    """A decode-only step's layout, `decodes` in the scheduler's order; `tokens` [R]: what they took."""

    decodes: list[Sequence]
    inputs: StepInputs
    indices: torch.Tensor  # `DecodeRows.slot_indices` of their positions
    tokens: torch.Tensor | None = None


class ForwardPath(Protocol):
    """Runs the steps it covers in place of the eager forward (compiled steps, CUDA graphs); chosen at start.
    `generated_apart`: its steps attend generated rows by another kernel than prompt rows, so a block of
    generated tokens is not interchangeable with the same tokens' block as a prompt (the prefix cache keeps them
    apart)."""

    generated_apart: bool

    def covers(self, inputs: StepInputs) -> bool: ...

    def __call__(self, inputs: StepInputs) -> torch.Tensor: ...


class EagerForward:
    """Every step through the eager forward: the forward path when no other is chosen."""

    generated_apart = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def covers(self, inputs: StepInputs) -> bool:
        return True

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        return self.runner.forward(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)


class ModelRunner:
    """A loaded model, its KV pool (`cache_config`'s heads, plus `spare_blocks`) and its backends."""

    def __init__(self, model: GPT2, config: EngineConfig, cache_config: GPT2Config | None = None,
                 spare_blocks: int = 0) -> None:
        self.config, self.model, self.device = config, model, resolve_device(config.device)
        self.cache_config = cache_config or model.config
        kv_dtype = resolve_dtype(config.kv_cache_dtype or config.dtype)
        self.pool = KVPool(self.cache_config, self._num_blocks(kv_dtype), config.block_size, kv_dtype, self.device,
                           spare_blocks=spare_blocks)
        self.scales, self.upcast = model.attention_scales(), model.config.reorder_and_upcast_attn
        self.backend = select_backend(config.attention_backend, self.device)
        self.attention_kind = InvariantAttention if config.invariance.attention else PagedAttention
        # new prompts attend in one call on a GPU (one small call each would idle it); one by one on the CPU
        self.batched_prefill = self.device.type == "cuda"
        self.forward_path: ForwardPath = EagerForward(self)
        self.decode_rows = DecodeRows(config.max_num_seqs, -(-model.config.n_positions // config.block_size),
                                      config.block_size, self.device)
        self._decoded: _Decoded | None = None  # the last step's, when it only decoded
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)", self.pool.num_blocks, config.block_size,
            self.pool.num_tokens, self.pool.nbytes / 2**20, str(kv_dtype).removeprefix("torch."),
        )

    def _num_blocks(self, kv_dtype: torch.dtype) -> int:
        config, bs = self.config, self.config.block_size
        if config.kv_cache_tokens:
            num_tokens = config.kv_cache_tokens
            num_blocks = num_tokens // bs
        else:  # from the memory budget, capped at max_num_seqs full contexts of whole blocks each
            num_tokens = config.kv_cache_memory // bytes_per_token(self.cache_config, kv_dtype)
            num_blocks = min(num_tokens // bs, config.max_num_seqs * -(-self.model.config.n_positions // bs))
        if num_blocks < 1:
            raise ValueError(f"KV pool of {num_tokens} tokens holds no block of {bs} tokens")
        return num_blocks

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [R, vocab] of the step's `logits_indices` rows; the step's K/V land in the pool."""
        if self.forward_path.covers(inputs):
            return self.forward_path(inputs)
        return self.forward(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                logits_rows: torch.Tensor | None) -> torch.Tensor:
        attention = self.attention_kind(self.pool.kv, meta, self.backend, self.scales, self.upcast)
        return self.model.run(input_ids, positions, attention, logits_rows)

    def prepare(self, chunks: list[tuple[Sequence, int]], decodes: list[Sequence] = (),
                ahead: Ahead | None = None) -> StepInputs:
        """The flat step: the (sequence, tokens to compute) chunks, then the decodes in their rows' order
        (`DecodeRows`), its host values sent in one copy. With `ahead`, each decode computes its token in `ahead`,
        one past its `token_ids`."""
        if ahead is not None and chunks:
            raise ValueError("a step laid out ahead decodes only: its chunks' tokens are all known")
        last, self._decoded = self._decoded, None
        if ahead is not None and last is not None and ahead.seqs == last.inputs.sample_seqs:
            last = replace(last, tokens=ahead.tokens)
        if last is not None and last.tokens is not None and not chunks and decodes == last.decodes:
            return self._advance(last)
        bs = self.config.block_size
        prefills = list(chunks)
        fresh = [chunk for seq, chunk in prefills if seq.num_computed_tokens == 0] if self.batched_prefill else []
        batched = len(fresh) > 1 and sum(fresh) <= MAX_BATCHED_PREFILL
        if batched:
            prefills.sort(key=lambda pair: pair[0].num_computed_tokens > 0)  # stable: those chunks first
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[tuple[int, int, int, list[int], int]] = []  # PrefillSegment's fields, block_table as a list
        rows: list[int] = []
        sample_seqs, sample_rows, prompt_rows = [], [], []
        for seq, chunk in prefills:
            start, first = len(ids), seq.num_computed_tokens
            end = first + chunk
            span = range(first, end)
            ids += (_token_at(seq, p) for p in span)
            positions += span
            slots += (seq.block_table[p // bs] * bs + p % bs for p in span)
            in_prompt = max(0, min(end, len(seq.prompt_token_ids)) - first)
            segments.append((start, chunk, end, seq.block_table[: -(-end // bs)], in_prompt))
            if seq.prompt_logprobs is not None:  # positions whose next prompt token is not scored yet
                wanted = [p for p in span if len(seq.prompt_logprobs) <= p + 1 < len(seq.prompt_token_ids)]
                if wanted:
                    prompt_rows.append((seq, len(rows), wanted))
                    rows += (start + p - first for p in wanted)
            if end == len(seq.token_ids) + len(seq.draft_token_ids) and not seq.scores_only:
                sample_seqs.append(seq)
                verified = range(end - num_sample_rows(seq), end)
                sample_rows += range(len(rows), len(rows) + len(verified))
                rows += (start + p - first for p in verified)
        num_prefill = len(ids)
        given = decodes
        decodes, table_entries, table_blocks = self.decode_rows.arrange(decodes)
        token_ids = list(map(attrgetter("token_ids"), decodes))
        lens = list(map(len, token_ids))
        # ahead: rows of ahead.tokens, replaced by their tokens on the device
        if ahead is None:
            ids += map(itemgetter(-1), token_ids)
        else:
            ids += map({seq: i for i, seq in enumerate(ahead.seqs)}.__getitem__, decodes)
            lens = list(map(add, lens, repeat(1)))
        positions += map(sub, lens, repeat(1))
        slot_indices = self.decode_rows.slot_indices(positions[num_prefill:])
        if decodes:
            sample_seqs += decodes
            sample_rows += range(len(rows), len(rows) + len(decodes))
            rows += range(num_prefill, num_prefill + len(decodes))
        prompt_tables = [seg[3] for seg in segments]
        # one copy: ids, positions, prompt slots, where the decode slots are, decode lengths, logits rows, the decode
        # tables' changed entries and their blocks, the prompts' block tables
        flat = to_device([*ids, *positions, *slots, *slot_indices, *lens, *rows, *table_entries, *table_blocks,
                          *(b for table in prompt_tables for b in table)], torch.int64, self.device)
        sizes = [len(ids), len(ids), num_prefill, len(slot_indices), len(lens), len(rows), len(table_entries),
                 len(table_blocks), *map(len, prompt_tables)]
        ids_t, positions_t, slots_t, indices_t, lens_t, rows_t, entries_t, blocks_t, *tables_t = flat.split(sizes)
        if ahead is not None:
            ids_t = ahead.tokens[ids_t]
        tables = decode_lens = None
        if decodes:
            if table_entries:
                self.decode_rows.write(entries_t, blocks_t)
            tables = self.decode_rows.block_tables(len(decodes))
            decode_lens = lens_t.to(torch.int32)
            decode_slots = self.decode_rows.slots_at(indices_t)
            slots_t = torch.cat([slots_t, decode_slots]) if num_prefill else decode_slots
        prefill_segments = [PrefillSegment(start, chunk, end, table, in_prompt)
                             for (start, chunk, end, _, in_prompt), table in zip(segments, tables_t, strict=True)]
        num_fresh = len(fresh) if batched else 0
        meta = StepMetadata(slots_t, prefill_segments, num_prefill, tables, decode_lens, num_fresh)
        inputs = StepInputs(ids_t, positions_t, meta, rows_t, sample_seqs, sample_rows, prompt_rows,
                            [seq for seq, _ in prefills])
        self._decoded = _Decoded(list(given), inputs, indices_t) if decodes and not num_prefill else None
        return inputs

    def took_tokens(self, tokens: torch.Tensor) -> None:
        """Each decode of the last step took its token in `tokens` (rows' order), and nothing else changed."""
        if self._decoded is not None:
            self._decoded.tokens = tokens

    def _advance(self, last: _Decoded) -> StepInputs:
        """`last`'s decodes a token further: its tensors advanced on the device; grown tables' entries the one copy."""
        rows, before = self.decode_rows, last.inputs
        seqs, entries, blocks = rows.arrange(before.sample_seqs)
        tables = before.meta.decode_block_tables
        if entries:
            rows.write(*to_device([*entries, *blocks], torch.int64, self.device).split(len(entries)))
            tables = rows.block_tables(len(seqs))
        indices = last.indices + 1
        meta = StepMetadata(rows.slots_at(indices), [], 0, tables, before.meta.decode_context_lens + 1, 0)
        inputs = StepInputs(last.tokens, before.positions + 1, meta, before.logits_indices, before.sample_seqs,
                            before.sample_rows, [], [])
        self._decoded = _Decoded(last.decodes, inputs, indices)
        return inputs

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K/V; a destination listed twice takes its last source."""
        if copies:
            last = {dst: src for src, dst in copies}
            self.pool.kv[:, :, self._tensor(list(last))] = self.pool.kv[:, :, self._tensor(list(last.values()))]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def problem(self) -> str | None:
        """Why this runner cannot run steps (a tensor-parallel rank gone); None: it can."""
        return None

    def close(self) -> None:
        self.pool.kv = torch.empty(0)
        self.backend.close()
        self.forward_path = EagerForward(self)
        self.decode_rows.clear()
        self._decoded = None


def _token_at(seq: Sequence, position: int) -> int:
    n = len(seq.token_ids)
    return seq.token_ids[position] if position < n else seq.draft_token_ids[position - n]
