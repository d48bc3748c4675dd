"""The model runner: the model, its KV pool and the step's tensors.

`prepare` lays a scheduled batch out as one flat step (`StepInputs`): the prompt chunks first, then one
token per decoding sequence, with positions, each token's slot in the pool and the pages each query
reads. `run` computes the logits of the rows that are sampled or scored, writing the step's K/V into the
pool: through the compiled steps where they cover the step, else through the model's layer loop with
paged attention. The attention backend and the compiled graphs are chosen once, at start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from minigpt.common.transfer import to_device
from minigpt.engine.config import EngineConfig
from minigpt.engine.cuda_graphs import DecodeGraphs, capture_sizes
from minigpt.engine.kv_cache import KVPool, bytes_per_token
from minigpt.engine.sequence import Sequence
from minigpt.model.attention import InvariantAttention, PagedAttention, PrefillSegment, StepMetadata
from minigpt.model.backends import select_backend
from minigpt.model.gpt2 import attention_inputs, attention_outputs, load_model
from minigpt.model.linears import prepare_linears, tile_rows
from minigpt.model.weights import resolve_device, resolve_dtype

if TYPE_CHECKING:
    from minigpt.tensor_parallel.shard import Shard

logger = logging.getLogger("minigpt")
MAX_BATCHED_PREFILL = 4096  # tokens of prompts attending in one call: its mask holds the square of this


@dataclass
class StepInputs:
    """One step laid out flat: what the model reads, and which logits rows go where afterwards."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    meta: StepMetadata
    logits_indices: torch.Tensor  # [R] int64: the rows whose logits are computed
    sample_seqs: list[Sequence]  # the sequences that sample this step
    sample_rows: list[int]  # their rows among the R: one each, plus one per drafted token it verifies
    # (sequence, its first row among the R, the prompt positions whose next token it scores)
    prompt_logprob_rows: list[tuple[Sequence, int, list[int]]]


class ModelRunner:
    """Loads the model (quantized or with the linears its device runs fastest), sizes and allocates the
    KV pool, picks the attention backend, compiles the steps (`compile=True`), and runs steps."""

    def __init__(self, path: Path, config: EngineConfig, shard: Shard | None = None) -> None:
        self.config = config
        dtype, self.device = resolve_dtype(config.dtype), resolve_device(config.device)
        self.model = load_model(path, dtype=dtype, device=self.device, shard=shard)
        if config.quantize is not None:
            from minigpt.quant.quantize import quantize

            quantize(self.model, config.quantize)
        else:
            prepare_linears(self.model, dtype, self.device)
        if config.batch_invariant and config.quantize != "w8a8":  # w8a8's integer products are per row already
            tile_rows(self.model)
        model_config = self.model.config
        # A tensor-parallel rank's pool holds its heads' pages only
        self.cache_config = model_config if shard is None else shard.cache_config(model_config)
        if shard is not None:
            shard.reduce_projections(self.model)
        kv_dtype = resolve_dtype(config.kv_cache_dtype or config.dtype)
        # CUDA graphs replay decode steps; a tensor-parallel rank's steps come from rank 0, eagerly
        graphs = self.device.type == "cuda" and not (config.enforce_eager or config.compile or shard is not None)
        self.pool = KVPool(self.cache_config, self._num_blocks(kv_dtype), config.block_size, kv_dtype, self.device,
                           spare_blocks=int(graphs))
        self.scales, self.upcast = self.model.attention_scales(), model_config.reorder_and_upcast_attn
        self.backend = select_backend(config.attention_backend, self.device)
        # the prompts a step starts attend in one call (a GPU would idle through one small call per prompt);
        # the CPU takes them one by one, each without the others' masked work
        self.batched_prefill = self.device.type == "cuda"
        self.halves: tuple[Callable, Callable] = (attention_inputs, attention_outputs)
        self.compiled = None
        if config.compile:
            from minigpt.compile.cache import ProgramCache
            from minigpt.compile.steps import CompiledSteps

            self.compiled = CompiledSteps(self.model, self.pool, ProgramCache(config.compile_cache_dir))
            self.halves = self.compiled.halves
            if self.backend.name == "torch":  # the decodes among prompts read their pages in place, compiled
                self.backend = self.compiled.decode_backend
        self.graphs = None
        if graphs:
            self.graphs = DecodeGraphs(
                self.forward, capture_sizes(config.max_num_seqs), -(-model_config.n_positions // config.block_size),
                self.pool.num_blocks, config.block_size, self.device,
            )
            self.graphs.capture_all()
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)", self.pool.num_blocks, config.block_size,
            self.pool.num_tokens, self.pool.nbytes / 2**20, str(kv_dtype).removeprefix("torch."),
        )

    def _num_blocks(self, kv_dtype: torch.dtype) -> int:
        config, bs = self.config, self.config.block_size
        if config.kv_cache_tokens:
            num_tokens = config.kv_cache_tokens
            num_blocks = num_tokens // bs
        else:  # from the memory budget, capped at max_num_seqs full contexts of whole pages each
            num_tokens = config.kv_cache_memory // bytes_per_token(self.cache_config, kv_dtype)
            num_blocks = min(num_tokens // bs, config.max_num_seqs * -(-self.model.config.n_positions // bs))
        if num_blocks < 1:
            raise ValueError(f"KV pool of {num_tokens} tokens holds no block of {bs} tokens")
        return num_blocks

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [R, vocab] of the step's `logits_indices` rows; the step's K/V land in the pool."""
        # the compiled decode steps attend their own way: batch_invariant steps all attend in `forward`
        if self.compiled is not None and not self.config.batch_invariant and self.compiled.covers(inputs):
            return self.compiled(inputs)
        if self.graphs is not None and self.graphs.covers(inputs):
            return self.graphs(inputs)
        return self.forward(inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
                logits_rows: torch.Tensor | None) -> torch.Tensor:
        """The eager step: the model's layer loop with paged attention (what the CUDA graphs capture)."""
        kind = InvariantAttention if self.config.batch_invariant else PagedAttention
        attention = kind(self.pool.kv, meta, self.backend, self.scales, self.upcast)
        return self.model.run(input_ids, positions, attention, logits_rows, self.halves)

    def prepare(self, chunks: list[tuple[Sequence, int]]) -> StepInputs:
        """The flat step for (sequence, tokens to compute) pairs: prompt chunks first, then decodes."""
        bs = self.config.block_size
        prefills: list[tuple[Sequence, int]] = []
        decodes: list[Sequence] = []
        for seq, chunk in chunks:
            # A decode is the one token left after a computed context; a single token of a prompt still
            # being computed (chunked prefill, a prefix-cache hit) is a prefill chunk like any other.
            if chunk == seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens > 0:
                decodes.append(seq)
            else:
                prefills.append((seq, chunk))
        # the chunks that start a prompt
        fresh = [chunk for seq, chunk in prefills if seq.num_computed_tokens == 0] if self.batched_prefill else []
        batched = len(fresh) > 1 and sum(fresh) <= MAX_BATCHED_PREFILL
        if batched:
            prefills.sort(key=lambda pair: pair[0].num_computed_tokens > 0)  # stable: those chunks first
        tokens: list[tuple[Sequence, int]] = []  # (sequence, position) of each row of the flat batch
        segments: list[PrefillSegment] = []
        rows: list[int] = []  # the rows whose logits are computed
        sample_seqs, sample_rows, prompt_rows = [], [], []
        for seq, chunk in prefills:
            start, first = len(tokens), seq.num_computed_tokens
            end = first + chunk
            tokens += ((seq, p) for p in range(first, end))
            # a cached prefix to read (batch_invariant: every chunk attends over its pages)
            pages = self._tensor(seq.block_table[: -(-end // bs)]) if first or self.config.batch_invariant else None
            segments.append(PrefillSegment(start, chunk, end, pages))
            if seq.prompt_logprobs is not None:  # positions whose next prompt token is not scored yet
                wanted = [p for p in range(first, end) if len(seq.prompt_logprobs) <= p + 1 < len(seq.prompt_token_ids)]
                if wanted:
                    prompt_rows.append((seq, len(rows), wanted))
                    rows += (start + p - first for p in wanted)
            if end == len(seq.token_ids) + len(seq.draft_token_ids) and not seq.scores_only:
                sample_seqs.append(seq)
                # the last token's row, then one row per drafted token being verified
                verified = range(end - 1 - len(seq.draft_token_ids), end)
                sample_rows += range(len(rows), len(rows) + len(verified))
                rows += (start + p - first for p in verified)
        num_prefill_tokens = len(tokens)
        for seq in decodes:
            sample_seqs.append(seq)
            sample_rows.append(len(rows))
            rows.append(len(tokens))
            tokens.append((seq, len(seq.token_ids) - 1))
        tables = lens = None
        if decodes:
            width = max(len(seq.block_table) for seq in decodes)
            padded = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in decodes]
            tables = to_device(padded, torch.int32, self.device)
            lens = to_device([len(seq.token_ids) for seq in decodes], torch.int32, self.device)
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in tokens]
        num_fresh = len(fresh) if batched else 0
        meta = StepMetadata(self._tensor(slots), segments, num_prefill_tokens, tables, lens, num_fresh)
        return StepInputs(
            self._tensor([_token_at(seq, p) for seq, p in tokens]), self._tensor([p for _, p in tokens]), meta,
            self._tensor(rows), sample_seqs, sample_rows, prompt_rows,
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K/V in every layer; a destination listed twice takes
        its last source."""
        if copies:
            last = {dst: src for src, dst in copies}
            self.pool.kv[:, :, self._tensor(list(last))] = self.pool.kv[:, :, self._tensor(list(last.values()))]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def problem(self) -> str | None:
        """Why this runner cannot run steps, if it cannot (a tensor-parallel rank gone); None: it can."""
        return None

    def close(self) -> None:
        """Free the KV pool and the compiled steps."""
        self.pool.kv = torch.empty(0)
        self.backend.close()
        self.compiled = self.graphs = None
        self.halves = (attention_inputs, attention_outputs)


def _token_at(seq: Sequence, position: int) -> int:
    """The token at `position` of seq's tokens followed by its drafted ones."""
    n = len(seq.token_ids)
    return seq.token_ids[position] if position < n else seq.draft_token_ids[position - n]
