"""Sampling parameters and the batched sampler.

The sampler turns one step's logits for a whole batch into next tokens in a single vectorized pass,
with each row carrying its own parameters. Every transform reproduces the matching transformers
logits processor, applied in transformers' order:

    repetition penalty -> presence/frequency penalties -> min_tokens mask
    -> temperature -> top-k -> top-p -> min-p -> sample (greedy rows: argmax of the penalised logits)

Sampled rows draw their randomness from a counter-based hash of (seed, number of tokens generated so
far, id) instead of a torch generator, so a row's token depends only on its own logits, seed and
step: not on what it is batched with, where it sits in the batch, or whether it was recomputed after
a preemption.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from minigpt.transfer import to_device

MAX_LOGPROBS = 20  # most alternatives a request may ask for, per token (OpenAI's limit)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad(field: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"SamplingParams.{field} must be {expected}, got {value!r}")


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily


@dataclass
class SamplingParams:
    """How to pick the tokens of one request; checked at construction and again at submission, where the
    engine takes its own copy: a field changed later can neither skip the checks nor alter a running request.

    temperature=0 is greedy, and so is any temperature below 1e-5 (dividing logits by much less
    overflows float32; vLLM draws the same line); top_k=0 disables top-k. `stop` and `stop_token_ids` are normalised to
    tuples (empty when not given). `logprobs` / `prompt_logprobs` ask for that many top alternatives
    per generated / prompt token (0: only the token's own logprob).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self.max_tokens = self._int("max_tokens", self.max_tokens, 1)
        self.top_k = self._int("top_k", self.top_k, 0)
        self.n = self._int("n", self.n, 1)
        self.min_tokens = self._int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, self._int(name, value, 0, MAX_LOGPROBS))

        self.temperature = self._real("temperature", self.temperature, lambda t: t >= 0, ">= 0")
        self.top_p = self._real("top_p", self.top_p, lambda p: 0 < p <= 1, "in (0, 1]")
        self.min_p = self._real("min_p", self.min_p, lambda p: 0 <= p <= 1, "in [0, 1]")
        self.repetition_penalty = self._real("repetition_penalty", self.repetition_penalty, lambda r: r > 0,
                                             "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, self._real(name, getattr(self, name), lambda x: -2 <= x <= 2, "in [-2, 2]"))

        if self.seed is not None:
            if not _is_int(self.seed):
                raise _bad("seed", self.seed, "an int or None")
            self.seed = int(self.seed)
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "a bool")
        self.stop = self._stop(self.stop)
        self.stop_token_ids = self._stop_token_ids(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Greedy requests take the argmax and never consume randomness."""
        return self.temperature < GREEDY_BELOW

    @staticmethod
    def _int(field: str, value: Any, lo: int, hi: int | None = None) -> int:
        if not _is_int(value) or value < lo or (hi is not None and value > hi):
            raise _bad(field, value, f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]")
        return int(value)

    @staticmethod
    def _real(field: str, value: Any, ok: Callable[[float], bool], expected: str) -> float:
        if not _is_real(value) or not math.isfinite(value) or not ok(value):
            raise _bad(field, value, f"a finite number {expected}")
        return float(value)

    @staticmethod
    def _stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        stops = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop", stop, "a non-empty str or a list of non-empty str")
        return tuple(stops)

    @staticmethod
    def _stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _bad("stop_token_ids", ids, "a list of non-negative ints")
        return tuple(int(i) for i in ids)


class SamplingRow(Protocol):
    """What the sampler needs to know about one running sequence (the engine's Sequence has it)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def seed(self) -> int: ...  # params.seed, or a random int the engine drew at submission

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


class TokenLogprobs(NamedTuple):
    """Log-probability of one token and its `k` most likely alternatives {token id: logprob}."""

    logprob: float
    top: dict[int, float]


@dataclass
class SamplerOutput:
    """Next token per row; `logprobs` is set when any row asked for them (None for rows that did not).

    Logprobs are log_softmax of the model's raw logits (over ids < vocab_limit), before penalties,
    temperature or filtering: they score what the model believes, comparable across sampling settings
    and with transformers' raw logits, and a greedy token's logprob is the model's own.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None


class Sampler:
    """Picks the next token of every row of a batch in one vectorized pass.

    Ids >= `vocab_limit` are never sampled: a checkpoint's embedding may be padded past the tokenizer's
    vocabulary. `eos_token_ids` are what `min_tokens` suppresses, along with each row's stop_token_ids.
    """

    def __init__(self, vocab_limit: int, eos_token_ids: Sequence[int] = ()) -> None:
        if not _is_int(vocab_limit) or vocab_limit < 1:
            raise ValueError(f"vocab_limit must be an int >= 1, got {vocab_limit!r}")
        self.vocab_limit = int(vocab_limit)
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Next token of each row from logits [len(rows), vocab] (any float dtype)."""
        logits = self._checked(logits, rows)
        if all(row.params.greedy and row.params.logprobs is None and self._untouched(row) for row in rows):
            # The every-step path: nothing to transform. In fp32: exact for any input dtype, and on the
            # CPU faster than a half-precision reduction even counting the cast.
            return SamplerOutput(argmax(logits.float()).tolist())

        x = self.process(logits, rows)
        params = [row.params for row in rows]
        seeds, steps = [row.seed for row in rows], [len(row.output_token_ids) for row in rows]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == len(rows):
            tokens = gumbel_argmax(x, seeds, steps)
        else:
            tokens = argmax(x)
            if sampled:
                idx = _tensor(sampled, torch.int64, x)
                tokens[idx] = gumbel_argmax(x[idx], [seeds[i] for i in sampled], [steps[i] for i in sampled])

        out = SamplerOutput(tokens.tolist())
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        if asked:
            idx = _tensor(asked, torch.int64, x)
            found = _logprobs(logits[idx], tokens[idx], [params[i].logprobs for i in asked])
            out.logprobs = [None] * len(rows)
            for i, lp in zip(asked, found, strict=True):
                out.logprobs[i] = lp
        return out

    def process(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """The fp32 logits [len(rows), vocab_limit] each row draws from, filtered ids at -inf.

        Every row gets its penalties and min_tokens mask; sampled rows then temperature, top-k, top-p
        and min-p. Greedy rows take the argmax of this. Never modifies `logits`.
        """
        x = self._checked(logits, rows).float()
        if any(_penalised(row.params) for row in rows):
            x = self._penalise(x, rows)
        suppress = [self._suppressed(row) for row in rows]
        if any(suppress):
            rows_idx = _tensor([i for i, ids in enumerate(suppress) for _ in ids], torch.int64, x)
            ids = _tensor([t for row_ids in suppress for t in row_ids], torch.int64, x)
            x = x.index_put((rows_idx, ids), torch.full((), -math.inf, device=x.device))
        params = [row.params for row in rows]
        return _on_rows(x, [i for i, p in enumerate(params) if not p.greedy], _warp, params)

    def _checked(self, logits: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        return logits[:, : self.vocab_limit]

    def _untouched(self, row: SamplingRow) -> bool:
        return not _penalised(row.params) and not self._suppressed(row)

    def _suppressed(self, row: SamplingRow) -> list[int]:
        """Token ids this row may not pick yet: EOS and its stop ids until it has min_tokens tokens."""
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            return []
        ids = {*p.stop_token_ids, *self.eos_token_ids}
        return sorted(i for i in ids if i < self.vocab_limit)

    def _penalise(self, x: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
        """Repetition penalty over prompt + output ids, then presence/frequency penalties over output ids.

        Rows without a penalty go through with factor 1 / offset 0 and no ids, which leaves them unchanged.
        """
        batch, vocab = x.shape
        params = [row.params for row in rows]
        if any(p.repetition_penalty != 1 for p in params):
            seen = [row.prompt_token_ids + row.output_token_ids if row.params.repetition_penalty != 1 else []
                    for row in rows]
            mask = _id_counts(seen, batch, vocab, x) > 0
            penalty = _tensor([p.repetition_penalty for p in params], torch.float32, x)[:, None]
            x = torch.where(mask, torch.where(x < 0, x * penalty, x / penalty), x)
        if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
            counts = _id_counts([row.output_token_ids for row in rows], batch, vocab, x)
            presence = _tensor([p.presence_penalty for p in params], torch.float32, x)[:, None]
            frequency = _tensor([p.frequency_penalty for p in params], torch.float32, x)[:, None]
            x = x - (frequency * counts + presence * (counts > 0))
        return x


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0


def _tensor(values: list, dtype: torch.dtype, like: Tensor) -> Tensor:
    return to_device(values, dtype, like.device)


def _id_counts(ids: list[list[int]], batch: int, vocab: int, like: Tensor) -> Tensor:
    """[batch, vocab] fp32 count of each id per row; ids >= vocab (never sampled) are dropped."""
    rows = [i for i, row_ids in enumerate(ids) for _ in row_ids]
    flat = _tensor([t for row_ids in ids for t in row_ids], torch.int64, like).clamp_(max=vocab)
    counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=like.device)
    counts.index_put_((_tensor(rows, torch.int64, like), flat), torch.ones_like(flat, dtype=torch.float32),
                      accumulate=True)
    return counts[:, :vocab]


def _warp(x: Tensor, params: list[SamplingParams]) -> Tensor:
    """Temperature, then top-k, top-p and min-p, each only on the rows that use it."""
    x = x / _tensor([p.temperature for p in params], torch.float32, x)[:, None]
    x = _on_rows(x, [i for i, p in enumerate(params) if p.top_k > 0], _top_k, [p.top_k for p in params])
    x = _on_rows(x, [i for i, p in enumerate(params) if p.top_p < 1], _top_p, [p.top_p for p in params])
    return _on_rows(x, [i for i, p in enumerate(params) if p.min_p > 0], _min_p, [p.min_p for p in params])


def _on_rows(x: Tensor, picked: list[int], transform: Callable[[Tensor, list], Tensor], values: list) -> Tensor:
    """x with rows `picked` replaced by transform(x[picked], values[picked]); the other rows skip the
    work (a sort, say). Out of place: x may be the caller's logits."""
    if len(picked) == x.shape[0]:
        return transform(x, values)
    if not picked:
        return x
    idx = _tensor(picked, torch.int64, x)
    return x.index_put((idx,), transform(x[idx], [values[i] for i in picked]))


def _top_k(x: Tensor, top_k: list[int]) -> Tensor:
    """TopKLogitsWarper per row: keep every logit >= the k-th largest (ties included)."""
    k = [min(k, x.shape[1]) for k in top_k]
    kth = x.topk(max(k), dim=-1).values.gather(1, _tensor(k, torch.int64, x)[:, None] - 1)
    return x.masked_fill(x < kth, -math.inf)


def _top_p(x: Tensor, top_p: list[float]) -> Tensor:
    """TopPLogitsWarper per row (min_tokens_to_keep=1): in ascending order, remove tokens whose
    cumulative probability is <= 1 - top_p; the most likely token always stays."""
    probs = x.softmax(dim=-1)
    # 1 - top_p rounds to fp32 as transformers' python scalar does.
    threshold = _tensor([1 - p for p in top_p], torch.float32, x)[:, None]
    # Any token with p <= threshold / vocab goes whatever its rank: everything up to it sums to at most
    # threshold. Only the others need ordering, and torch's CPU sort is several times faster on a row
    # of repeated -inf keys. Halving the bound leaves room for the float error of the cumulative sum.
    surely_removed = probs <= threshold / (2 * x.shape[1])
    order = x.masked_fill(surely_removed, -math.inf).argsort(dim=-1)
    remove = probs.gather(1, order).cumsum(dim=-1) <= threshold
    remove[:, -1] = False
    return x.masked_fill(remove.scatter(1, order, remove), -math.inf)


def _min_p(x: Tensor, min_p: list[float]) -> Tensor:
    """MinPLogitsWarper per row: drop tokens less likely than min_p times the most likely one."""
    probs = x.softmax(dim=-1)
    scale = _tensor(min_p, torch.float32, x)[:, None]
    return x.masked_fill(probs < scale * probs.amax(dim=-1, keepdim=True), -math.inf)


# Randomness: a counter-based hash of (seed, step, stream, id). Python ints mix each row's 64-bit key
# (exact, arbitrary precision); tensor ops spread it over the ids. Tensor values stay below 2**32 in
# int64 and every product below 2**63, so nothing relies on signed overflow.
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_keys(seeds: Sequence[int], steps: Sequence[int], stream: int = 0) -> list[int]:
    """One 64-bit key per row from (seed, step, stream): distinct streams give independent noise."""
    return [_splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ step) ^ stream)
            for seed, step in zip(seeds, steps, strict=True)]


def _mul32(x: Tensor, c: int) -> Tensor:
    """x * c mod 2**32 for x < 2**32, split in 16-bit halves of c so no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection on [0, 2**32); each input bit flips ~half the output."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(keys: Sequence[int], ids: Tensor) -> Tensor:
    """Standard Gumbel noise, fp64, one value per (row key, id) for int64 ids [rows, m] in [0, 2**32).

    The uniform u = (hash + 1/2) / 2**32 lies strictly inside (0, 1), so the noise is finite; fp64
    keeps all 32 bits, so only ids over ~26 nats below the best can never win (fp32: ~19).
    """
    lo = to_device([k & _MASK32 for k in keys], torch.int64, ids.device)[:, None]
    hi = to_device([k >> 32 for k in keys], torch.int64, ids.device)[:, None]
    h = _fmix32((_fmix32(ids ^ lo) + hi) & _MASK32)  # two rounds: every key bit reaches every output bit
    u = (h.to(torch.float64) + 0.5) * 2.0**-32
    return -torch.log(-torch.log(u))


ARGMAX_BLOCK = 256  # columns reduced together by `argmax` on the CPU


def argmax(x: Tensor) -> Tensor:
    """Index of the first maximum of each row of x [rows, n], NaN counting as the maximum: what
    `x.argmax(-1)` returns.

    On the CPU torch's argmax (and max with indices) is not vectorized: 5.2 ms over 100 rows of
    GPT-2's 50k logits on 2 cores, against 0.4 ms for `amax`. So each row's maximum is found among
    the maxima of its blocks of `ARGMAX_BLOCK` columns, then inside the first block holding it
    (1.1 ms; the same at one row)."""
    if x.device.type != "cpu" or x.numel() == 0:
        return x.argmax(dim=-1)
    rows, n = x.shape
    full = n - n % ARGMAX_BLOCK
    maxima = x[:, :full].view(rows, -1, ARGMAX_BLOCK).amax(dim=-1)
    if full < n:
        maxima = torch.cat([maxima, x[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    start = maxima.argmax(dim=-1, keepdim=True) * ARGMAX_BLOCK
    # the last block may be short: its columns past the end repeat the last one, after the real ones
    columns = (start + torch.arange(ARGMAX_BLOCK, device=x.device)).clamp_(max=n - 1)
    return (start + x.gather(1, columns).argmax(dim=-1, keepdim=True)).squeeze(1)


def gumbel_argmax(x: Tensor, seeds: Sequence[int], steps: Sequence[int]) -> Tensor:
    """One draw per row from softmax(x), reproducible from (seed, step) alone.

    Gumbel-max in two levels, each exact because softmax factorizes: pick a block of ~sqrt(vocab) ids
    by Gumbel-max over the blocks' log-masses, then an id inside it by Gumbel-max over its logits. That
    needs ~2 * sqrt(vocab) hashed uniforms per row instead of vocab (the integer hash is slow on CPU:
    int64 multiplies do not vectorize) for the price of one softmax. Noise is keyed by block / token
    id, never by row position, so a row's draw ignores the rest of the batch; and small logit drift
    (a recompute after preemption) rarely moves a Gumbel-max winner, unlike inverse-CDF sampling.
    """
    rows, vocab = x.shape
    size = math.isqrt(vocab - 1) + 1  # ids per block
    blocks = -(-vocab // size)
    probs = torch.nn.functional.pad(x.softmax(dim=-1), (0, blocks * size - vocab))
    log_mass = probs.view(rows, blocks, size).sum(dim=-1).log_().double()  # [rows, blocks]; empty: -inf
    block_ids = torch.arange(blocks, device=x.device).expand(rows, blocks)
    block = (log_mass + gumbel_noise(row_keys(seeds, steps, 0), block_ids)).argmax(dim=-1)  # [rows]
    token_ids = block[:, None] * size + torch.arange(size, device=x.device)  # [rows, size]
    inner = x.gather(1, token_ids.clamp(max=vocab - 1)).masked_fill_(token_ids >= vocab, -math.inf).double()
    inner += gumbel_noise(row_keys(seeds, steps, 1), token_ids)
    return token_ids.gather(1, inner.argmax(dim=-1, keepdim=True)).squeeze(1)


def _logprobs(logits: Tensor, chosen: Tensor, ks: Sequence[int]) -> list[TokenLogprobs]:
    """Logprob of `chosen[i]` under log_softmax(logits[i]) and row i's top-ks[i] alternatives."""
    logp = logits.float().log_softmax(dim=-1)
    picked = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
    values, ids = logp.topk(min(max(ks), logp.shape[1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(lp, dict(zip(ids[i][:k], values[i][:k], strict=True)))
            for i, (lp, k) in enumerate(zip(picked, ks, strict=True))]


def prompt_logprobs(logits: Tensor, target_ids: Tensor | Sequence[int], k: int,
                    vocab_limit: int | None = None) -> list[TokenLogprobs]:
    """Per-position logprobs of a prompt, for scoring and loglikelihood evaluation.

    logits[t] is the model's prediction after prompt position t and target_ids[t] the token that
    actually followed, so a whole prompt p gives logits[:-1] with p[1:] (the first token has none).
    Like generated-token logprobs they come from the raw distribution, before any sampling transform.
    """
    if logits.dim() != 2 or len(target_ids) != logits.shape[0]:
        raise ValueError(f"logits must be [T, vocab] with T = len(target_ids) = {len(target_ids)}, "
                         f"got {tuple(logits.shape)}")
    if not _is_int(k) or not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"k must be an int in [0, {MAX_LOGPROBS}], got {k!r}")
    targets = torch.as_tensor(target_ids, dtype=torch.int64, device=logits.device)
    return _logprobs(logits[:, :vocab_limit], targets, [k] * len(targets))
