"""The benchmark workloads of the seed scenarios, deterministic from a seed.

Every engine (minigpt and its peers in ``scripts/peers/``) receives the same prompt token ids, so
the workloads are defined in tokens: a prompt is generated as English-ish text and cut to an exact
token count with the checkpoint's own GPT-2 BPE. Nothing here runs a model.

    seed 000   N concurrent prompts (5-40 tokens) x 64 greedy tokens, one-at-a-time vs batched
    seed 002   throughput and per-token latency for batch sizes 1..128
    seed 001/3 one stream: an 8-token prompt, 128 greedy tokens (TTFT, TPOT)
    serving    Poisson arrivals at several rates, mixed prompt and output lengths

``scripts/bench.py`` builds these and hands them to each engine adapter; minigpt plugs in there as
one more adapter (see ``scripts/peers/base.py``: ``Peer``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Encode = Callable[[str], list[int]]

# Common English words: each is one GPT-2 token with its leading space, so prompts read like text
# and the token count of a prompt is easy to steer.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is that for it as was with be by on not he this are or his from at which
    but have an they you were her she there one all we their has been would will more if no when
    what so who said about out up them some could into than other time only new its then these
    two may first any like now my such over our man me even most made after also did many before
    must through back years where much your way well down should because each just those people
    how too little state good very make world still own see men work long get here between both
    life being under never day same another know while last might us great old year off come
    since against go came right used take three small large city house water light music river
    garden morning evening window table letter story market winter summer history number school
    family country question place power point money system program night word part change case
    """.split()
)
STARTS: tuple[str, ...] = ("The", "In", "When", "A", "Yesterday", "Some", "Every", "After", "Our", "This")

BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
SERVING_RATES: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0)  # requests per second


@dataclass(frozen=True)
class Prompt:
    """One prompt: the text it came from and the exact token ids every engine receives."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class BatchWorkload:
    """Prompts that all arrive at once, each generating exactly ``max_new_tokens`` greedy tokens."""

    name: str
    prompts: list[Prompt]
    max_new_tokens: int

    @property
    def prompt_token_ids(self) -> list[list[int]]:
        return [p.token_ids for p in self.prompts]

    @property
    def total_new_tokens(self) -> int:
        return len(self.prompts) * self.max_new_tokens


@dataclass(frozen=True)
class StreamWorkload:
    """A single request, timed token by token: time to first token and time per output token."""

    name: str
    prompt: Prompt
    max_new_tokens: int


@dataclass(frozen=True)
class ServingRequest:
    """One request of a serving run: when it arrives (seconds from the start) and what it asks."""

    arrival_s: float
    prompt: Prompt
    max_new_tokens: int


@dataclass(frozen=True)
class ServingWorkload:
    """Requests arriving as a Poisson process at ``rate`` requests per second."""

    name: str
    rate: float
    requests: list[ServingRequest] = field(default_factory=list)

    @property
    def total_new_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)


def load_encoder(checkpoint_dir: str | Path) -> Encode:
    """The checkpoint's own GPT-2 BPE (minigpt's tiktoken-backed tokenizer; no network), without
    special-token parsing so every engine sees plain text ids."""
    from minigpt.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_dir(checkpoint_dir).encoding.encode_ordinary


def make_prompt(encode: Encode, n_tokens: int, rng: random.Random) -> Prompt:
    """An English-ish sentence cut to exactly ``n_tokens`` tokens."""
    words = [rng.choice(STARTS)]
    ids = encode(words[0])
    while len(ids) < n_tokens:
        words.append(rng.choice(WORDS))
        if rng.random() < 0.08:
            words[-1] += rng.choice((",", ".", ";"))
        ids = encode(" ".join(words))
    return Prompt(text=" ".join(words), token_ids=ids[:n_tokens])


def make_prompts(
    encode: Encode, n: int, min_tokens: int = 5, max_tokens: int = 40, seed: int = 0
) -> list[Prompt]:
    """``n`` prompts with lengths uniform in [min_tokens, max_tokens], the same for a given seed."""
    rng = random.Random(seed)
    return [make_prompt(encode, rng.randint(min_tokens, max_tokens), rng) for _ in range(n)]


def seed000(encode: Encode, n_prompts: int = 100, max_new_tokens: int = 64, seed: int = 0) -> BatchWorkload:
    """Seed 000: N concurrent queries (5-40 tokens), 64 greedy tokens each."""
    prompts = make_prompts(encode, n_prompts, 5, 40, seed=seed)
    return BatchWorkload(f"seed000-{n_prompts}x{max_new_tokens}", prompts, max_new_tokens)


def seed002(
    encode: Encode,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    max_new_tokens: int = 64,
    seed: int = 2,
) -> list[BatchWorkload]:
    """Seed 002: one batch per size; the batch of size b is the first b prompts of one fixed pool."""
    pool = make_prompts(encode, max(batch_sizes), 5, 40, seed=seed)
    return [BatchWorkload(f"seed002-b{b}", pool[:b], max_new_tokens) for b in batch_sizes]


def seed001(encode: Encode, prompt_tokens: int = 8, max_new_tokens: int = 128, seed: int = 1) -> StreamWorkload:
    """Seed 001/003: one stream, an 8-token prompt, 128 greedy tokens."""
    rng = random.Random(seed)
    return StreamWorkload(
        f"stream-p{prompt_tokens}-n{max_new_tokens}", make_prompt(encode, prompt_tokens, rng), max_new_tokens
    )


def serving(
    encode: Encode,
    rate: float,
    n_requests: int = 64,
    seed: int = 3,
    short_prompt: tuple[int, int] = (5, 40),
    long_prompt: tuple[int, int] = (100, 300),
    long_fraction: float = 0.3,
    new_tokens: tuple[int, int] = (16, 128),
) -> ServingWorkload:
    """Poisson arrivals at ``rate`` req/s; prompts mostly short with a long tail, outputs 16-128.

    The same seed gives the same requests at every rate (only the gaps are scaled), so rates are
    comparable. Longest request: 300 + 128 tokens, well inside GPT-2's 1024 positions.
    """
    rng = random.Random(seed)
    requests: list[ServingRequest] = []
    t = 0.0
    for _ in range(n_requests):
        lo, hi = long_prompt if rng.random() < long_fraction else short_prompt
        prompt = make_prompt(encode, rng.randint(lo, hi), rng)
        requests.append(ServingRequest(t / rate, prompt, rng.randint(*new_tokens)))
        t += rng.expovariate(1.0)
    return ServingWorkload(f"serving-{rate:g}rps-{n_requests}req", rate, requests)


def serving_sweep(
    encode: Encode, rates: Sequence[float] = SERVING_RATES, n_requests: int = 64, seed: int = 3
) -> list[ServingWorkload]:
    """The serving workload at each rate."""
    return [serving(encode, r, n_requests=n_requests, seed=seed) for r in rates]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) without numpy."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


if __name__ == "__main__":
    import sys

    enc = load_encoder(sys.argv[1] if len(sys.argv) > 1 else "/work/peers/gpt2-random")
    w = seed000(enc)
    lens = [len(p.token_ids) for p in w.prompts]
    print(w.name, "prompt tokens min/mean/max", min(lens), sum(lens) / len(lens), max(lens))
    print(repr(w.prompts[0].text), w.prompts[0].token_ids)
    s = seed001(enc)
    print(s.name, repr(s.prompt.text), s.prompt.token_ids)
    for sw in serving_sweep(enc):
        print(sw.name, f"last arrival {sw.requests[-1].arrival_s:.1f}s", "new tokens", sw.total_new_tokens)
