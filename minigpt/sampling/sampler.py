"""A batch's next tokens in one vectorized pass, each row with its own parameters; transformers' processors
in its order, after the mask, bias and allowed ids that act on the raw logits first (as in vLLM):

    grammar mask -> logit bias -> allowed ids -> repetition penalty -> presence/frequency penalties -> min_tokens mask
    -> temperature -> top-k -> top-p -> min-p -> sample (greedy rows: argmax of the penalised logits)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter
from typing import NamedTuple

import torch
from torch import Tensor

from minigpt.sampling.bitmask import apply_bitmask
from minigpt.sampling.generator import gumbel_argmax
from minigpt.sampling.params import MAX_LOGPROBS, SamplingParams, biased, is_int, penalised
from minigpt.sampling.processors import SamplingRow, bias, on_rows, penalise, suppress, tensor_like, warp


class TokenLogprobs(NamedTuple):
    """Log-probability of one token and its `k` most likely alternatives {token id: logprob}."""

    logprob: float
    top: dict[int, float]


@dataclass
class SamplerOutput:
    """Next token per row; `logprobs` (of the raw logits, before any transform) when a row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    tokens: Tensor | None = None  # token_ids on the logits' device


class Sampler:
    """Ids >= `vocab_limit` (an embedding padded past the tokenizer) are never picked; `min_tokens` suppresses
    `eos_token_ids` and each row's stop_token_ids."""

    def __init__(self, vocab_limit: int, eos_token_ids: Sequence[int] = ()) -> None:
        if not is_int(vocab_limit) or vocab_limit < 1:
            raise ValueError(f"vocab_limit must be an int >= 1, got {vocab_limit!r}")
        self.vocab_limit = int(vocab_limit)
        self.eos_token_ids = tuple(eos_token_ids)
        self._maskable_eos = {i for i in self.eos_token_ids if i < self.vocab_limit}

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None = None
                 ) -> SamplerOutput:
        """logits: [len(rows), vocab], any float dtype; `bitmask`: int32 [len(rows), words], the tokens each row
        may take (a grammar's), bit j of word i token 32 i + j."""
        tokens, batch = self._draw(logits, rows, bitmask, 0)
        out = SamplerOutput(tokens.tolist(), tokens=tokens)
        asked = [] if batch is None else [i for i, p in enumerate(batch.params) if p.logprobs is not None]
        if asked:
            idx = tensor_like(asked, torch.int64, tokens)
            found = _logprobs(batch.logits[idx], tokens[idx], [batch.params[i].logprobs for i in asked])
            out.logprobs = [None] * len(rows)
            for i, lp in zip(asked, found, strict=True):
                out.logprobs[i] = lp
        return out

    def draw(self, logits: Tensor, rows: Sequence[SamplingRow], ahead: int = 0) -> Tensor:
        """The tokens [len(rows)] `__call__` would give, left on the logits' device; each row `ahead` tokens
        past its `output_token_ids` (drawn before the last step's tokens are read: no penalties then)."""
        if ahead and any(penalised(row.params) for row in rows):
            raise ValueError("penalties count the tokens drawn before: draw a penalised row with ahead=0")
        return self._draw(logits, rows, None, ahead)[0]

    def _draw(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None, ahead: int
              ) -> tuple[Tensor, _Batch | None]:
        if bitmask is None and all(map(_argmax_only, rows)):
            _check_shape(logits, rows)
            # nothing to transform; fp32: exact for any dtype, and on the CPU faster than a half-precision argmax
            return argmax(_first_columns(logits, self.vocab_limit).float()), None
        batch = self._batch(logits, rows, bitmask, ahead)
        sampled = batch.sampled
        x = self._process(batch)
        seeds, steps = [row.seed for row in rows], [len(row.output_token_ids) + ahead for row in rows]
        if len(sampled) == len(rows):
            return gumbel_argmax(x, seeds, steps), batch
        tokens = argmax(x)
        if sampled:
            idx = tensor_like(sampled, torch.int64, x)
            tokens[idx] = gumbel_argmax(x[idx], [seeds[i] for i in sampled], [steps[i] for i in sampled])
        return tokens, batch

    def process(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None = None) -> Tensor:
        """The fp32 logits [len(rows), vocab_limit] each row draws from (greedy rows: its argmax), out of place."""
        return self._process(self._batch(logits, rows, bitmask, 0))

    def _batch(self, logits: Tensor, rows: Sequence[SamplingRow], bitmask: Tensor | None, ahead: int
               ) -> _Batch:
        _check_shape(logits, rows)
        params = [row.params for row in rows]
        return _Batch(rows, _first_columns(logits, self.vocab_limit), params,
                      [self._suppressed(row, ahead) for row in rows], any(penalised(p) for p in params),
                      any(biased(p) for p in params),
                      [i for i, p in enumerate(params) if not p.greedy], bitmask)

    def _process(self, batch: _Batch) -> Tensor:
        x = batch.logits.float()
        if batch.bitmask is not None:
            x = apply_bitmask(x, batch.bitmask)
        if batch.biased:
            x = bias(x, batch.params)
        if batch.penalised:
            x = penalise(x, batch.rows)
        if any(batch.suppressed):
            x = suppress(x, batch.suppressed)
        return on_rows(x, batch.sampled, warp, batch.params)

    def _suppressed(self, row: SamplingRow, ahead: int) -> list[int]:
        p = row.params
        if len(row.output_token_ids) + ahead >= p.min_tokens:
            return []
        return sorted({*(i for i in p.stop_token_ids if i < self.vocab_limit), *self._maskable_eos})


_argmax_only = attrgetter("params.argmax_only")  # a loop in C over a step's rows


def _first_columns(x: Tensor, n: int) -> Tensor:
    return x if x.shape[1] == n else x[:, :n]


def _check_shape(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")


class _Batch(NamedTuple):
    rows: Sequence[SamplingRow]
    logits: Tensor  # [len(rows), vocab_limit], the caller's dtype
    params: list[SamplingParams]
    suppressed: list[list[int]]  # per row: EOS and stop ids until min_tokens
    penalised: bool
    biased: bool  # some row has a logit_bias or allowed_token_ids
    sampled: list[int]  # the rows that are not greedy
    bitmask: Tensor | None  # int32 [len(rows), words]: the tokens each row may take


def argmax(x: Tensor) -> Tensor:
    """`x.argmax(-1)` of x [rows, n]. On the CPU one row through `max`, one op (in a decode step, where each op
    starts with its code out of the near caches, fewer ops beat the block maxima's faster arithmetic); more rows
    through the maxima of blocks of about sqrt(n) columns, as `amax` is vectorized and argmax and `max` are not:
    the argmax of the blocks' maxima, then of the chosen block's columns."""
    if x.device.type != "cpu" or x.numel() == 0:
        return x.argmax(dim=-1)
    rows, n = x.shape
    if rows == 1:
        return x.max(dim=-1).indices
    block = 1 << round(math.log2(n) / 2)  # a power of two: both argmaxes about sqrt(n) wide
    full = n - n % block
    maxima = _first_columns(x, full).view(rows, -1, block).amax(dim=-1)
    if full < n:
        maxima = torch.cat([maxima, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1, keepdim=True).mul_(block)
    columns = _block_columns(block, x.device) + start
    if full < n:  # the last block is short: its columns past the end repeat the last one, after the real ones
        columns.clamp_(max=n - 1)
    return x.gather(1, columns).argmax(dim=-1).add_(start.view(-1))


@lru_cache(maxsize=8)
def _block_columns(block: int, device: torch.device) -> Tensor:
    return torch.arange(block, device=device)


def _logprobs(logits: Tensor, chosen: Tensor, ks: Sequence[int]) -> list[TokenLogprobs]:
    logp = logits.float().log_softmax(dim=-1)
    picked = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
    values, ids = logp.topk(min(max(ks), logp.shape[1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(lp, dict(zip(ids[i][:k], values[i][:k], strict=True)))
            for i, (lp, k) in enumerate(zip(picked, ks, strict=True))]


def prompt_logprobs(logits: Tensor, target_ids: Tensor | Sequence[int], k: int,
                    vocab_limit: int | None = None) -> list[TokenLogprobs]:
    """Raw logprobs of target_ids[t] after position t: a prompt p gives logits[:-1] with p[1:]."""
    if logits.dim() != 2 or len(target_ids) != logits.shape[0]:
        raise ValueError(f"logits must be [T, vocab] with T = len(target_ids) = {len(target_ids)}, "
                         f"got {tuple(logits.shape)}")
    if not is_int(k) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"k must be an int in [0, {MAX_LOGPROBS}], got {k!r}")
    targets = torch.as_tensor(target_ids, dtype=torch.int64, device=logits.device)
    return _logprobs(logits[:, :vocab_limit], targets, [k] * len(targets))
