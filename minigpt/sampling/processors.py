"""Logits processors, each reproducing the matching transformers processor, batched with per-row values:
logit bias and allowed ids, penalties, the min_tokens mask, then temperature, top-k, top-p and min-p warping."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Protocol

import torch
from torch import Tensor

from minigpt.common.transfer import to_device
from minigpt.sampling.params import SamplingParams


class SamplingRow(Protocol):
    @property
    def params(self) -> SamplingParams: ...

    @property
    def seed(self) -> int: ...  # params.seed, or a random int the engine drew at submission

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


def bias(x: Tensor, params: list[SamplingParams]) -> Tensor:
    """logit_bias added, then ids outside allowed_token_ids at -inf; ids >= vocab dropped; out of place."""
    vocab = x.shape[1]
    added = [{i: b for i, b in (p.logit_bias or {}).items() if i < vocab} for p in params]
    if any(added):
        values = tensor_like([b for row in added for b in row.values()], torch.float32, x)
        x = x.index_put(_flat([list(row) for row in added], x), values, accumulate=True)
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if restricted:
        blocked = torch.zeros_like(x, dtype=torch.bool)
        blocked[tensor_like(restricted, torch.int64, x)] = True
        allowed = [[t for t in p.allowed_token_ids or () if t < vocab] for p in params]
        blocked[_flat(allowed, x)] = False
        x = x.masked_fill(blocked, -math.inf)
    return x


def tensor_like(values: list, dtype: torch.dtype, like: Tensor) -> Tensor:
    return to_device(values, dtype, like.device)


def penalise(x: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Repetition penalty over prompt + output ids, then presence/frequency penalties over output ids: each at
    the (row, id) pairs it touches, out of place (a dense [rows, vocab] count would be written every step)."""
    vocab = x.shape[1]
    params = [row.params for row in rows]
    x = x.clone()
    if any(p.repetition_penalty != 1 for p in params):
        seen = [row.prompt_token_ids + row.output_token_ids if row.params.repetition_penalty != 1 else []
                for row in rows]
        at = _pairs(seen, vocab, x)
        penalty = tensor_like([p.repetition_penalty for p in params], torch.float32, x)[at[0]]
        score = x[at]  # read before any write: an id seen twice gets the same value twice
        x[at] = torch.where(score < 0, score * penalty, score / penalty)
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
        row_ids, id_ids = _pairs([row.output_token_ids for row in rows], vocab, x)
        pairs, counts = torch.unique(row_ids * vocab + id_ids, return_counts=True)
        at = (pairs // vocab, pairs % vocab)
        presence = tensor_like([p.presence_penalty for p in params], torch.float32, x)[at[0]]
        frequency = tensor_like([p.frequency_penalty for p in params], torch.float32, x)[at[0]]
        x[at] = x[at] - (frequency * counts + presence)
    return x


def _pairs(ids: list[list[int]], vocab: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """(row, id) of every id below `vocab` in `ids` (ids past it are a padded embedding's: never sampled)."""
    rows, flat = _flat(ids, like)
    kept = flat < vocab
    return rows[kept], flat[kept]


def suppress(x: Tensor, ids: list[list[int]]) -> Tensor:
    return x.index_put(_flat(ids, x), torch.full((), -math.inf, device=x.device))


def _flat(ids: list[list[int]], like: Tensor) -> tuple[Tensor, Tensor]:
    """The row index of every id in `ids` and the ids, flat: C loops (a row may hold thousands of ids)."""
    lengths = list(map(len, ids))
    counts = tensor_like(lengths, torch.int64, like)
    rows = torch.repeat_interleave(torch.arange(len(ids), device=like.device), counts, output_size=sum(lengths))
    return rows, tensor_like(list(chain.from_iterable(ids)), torch.int64, like)


def warp(x: Tensor, params: list[SamplingParams]) -> Tensor:
    x = x / tensor_like([p.temperature for p in params], torch.float32, x)[:, None]
    x = on_rows(x, [i for i, p in enumerate(params) if p.top_k > 0], _top_k, [p.top_k for p in params])
    x = on_rows(x, [i for i, p in enumerate(params) if p.top_p < 1], _top_p, [p.top_p for p in params])
    return on_rows(x, [i for i, p in enumerate(params) if p.min_p > 0], _min_p, [p.min_p for p in params])


def on_rows(x: Tensor, picked: list[int], transform: Callable[[Tensor, list], Tensor], values: list) -> Tensor:
    """x with rows `picked` replaced by transform(x[picked], values[picked]), out of place."""
    if len(picked) == x.shape[0]:
        return transform(x, values)
    if not picked:
        return x
    idx = tensor_like(picked, torch.int64, x)
    return x.index_put((idx,), transform(x[idx], [values[i] for i in picked]))


def _top_k(x: Tensor, top_k: list[int]) -> Tensor:
    """Keeps every logit >= the k-th largest (ties included)."""
    k = [min(k, x.shape[1]) for k in top_k]
    kth = x.topk(max(k), dim=-1).values.gather(1, tensor_like(k, torch.int64, x)[:, None] - 1)
    return x.masked_fill(x < kth, -math.inf)


def _top_p(x: Tensor, top_p: list[float]) -> Tensor:
    """TopPLogitsWarper with min_tokens_to_keep=1."""
    probs = x.softmax(dim=-1)
    threshold = tensor_like([1 - p for p in top_p], torch.float32, x)[:, None]
    # p <= threshold / vocab goes whatever its rank, so only the rest need sorting (halved for cumsum's error)
    surely_removed = probs <= threshold / (2 * x.shape[1])
    order = x.masked_fill(surely_removed, -math.inf).argsort(dim=-1)
    remove = probs.gather(1, order).cumsum(dim=-1) <= threshold
    remove[:, -1] = False
    return x.masked_fill(remove.scatter(1, order, remove), -math.inf)


def _min_p(x: Tensor, min_p: list[float]) -> Tensor:
    probs = x.softmax(dim=-1)
    scale = tensor_like(min_p, torch.float32, x)[:, None]
    return x.masked_fill(probs < scale * probs.amax(dim=-1, keepdim=True), -math.inf)
