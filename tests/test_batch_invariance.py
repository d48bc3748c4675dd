"""Same request, same bits: a request's token ids, logprobs and prompt logprobs are bitwise the same
whatever it is batched with, however its prompt is chunked, whether its prefix came from the cache,
whether it was preempted and recomputed, and whether speculation drafted for it.

Each mode that promises it (docs/batch-invariance.md) runs a few cases drawn by a seeded
`random.Random`: the target prompt alone in an engine that neither chunks nor preempts, then among
random others of random lengths, with a random step budget (chunked prefill), a pool small enough to
preempt, others sharing its prefix (prefix-cache hits) and n-gram speculation.
"""

from __future__ import annotations

import random

import pytest

from minigpt import LLM, SamplingParams
from minigpt.engine.config import EngineConfig

N_POSITIONS = 128
MAX_TOKENS = 24
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, prompt_logprobs=3, ignore_eos=True)
VOCAB = 50257

MODES = {
    "w8a8": dict(quantize="w8a8", batch_invariant=True),
    "float32": dict(batch_invariant=True),
    "bfloat16": dict(dtype="bfloat16", batch_invariant=True),
}


def outcome(out) -> tuple:
    """Everything about one output that must not move: token ids, logprobs with their alternatives,
    prompt logprobs (floats compared as floats: equal means bitwise here, no NaN can appear)."""
    def logprobs(entries):
        return [None if e is None else (e.logprob, sorted(e.top.items())) for e in entries]

    return out.token_ids, logprobs(out.logprobs), logprobs(out.prompt_logprobs)


def draw_case(rng: random.Random, target: list[int]) -> dict:
    """Random company for `target`: others of random lengths (some sharing its prefix), a step budget,
    a pool size, speculation or not."""
    others = []
    for _ in range(rng.randrange(1, 6)):
        length = rng.randrange(1, N_POSITIONS - MAX_TOKENS)
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        if rng.random() < 0.4:  # shares the target's first pages
            shared = rng.randrange(1, len(target))
            prompt = target[:shared] + prompt[: max(1, length - shared)]
        others.append(prompt)
    position = rng.randrange(len(others) + 1)
    return {
        "prompts": others[:position] + [target] + others[position:],
        "position": position,
        "warm_prefix": rng.random() < 0.5,  # the target's prefix cached by an earlier request
        "engine": {
            "max_num_batched_tokens": rng.choice([8, 16, 33, 64, 2048]),
            "kv_cache_tokens": rng.choice([N_POSITIONS, 2 * N_POSITIONS, 4096]),  # the smallest ones preempt
            "speculative_config": rng.choice([None, {"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_max": 3, "prompt_lookup_min": 1}]),
        },
    }


def target_prompt(rng: random.Random) -> list[int]:
    """A prompt whose n-grams repeat, so that n-gram speculation drafts for it."""
    motif = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 8))]
    return (motif * 20)[: rng.randrange(20, N_POSITIONS - MAX_TOKENS - 8)]


def check_invariant(path, mode: dict, seed: int, cases: int) -> None:
    """`cases` random cases against the target alone; among them, the target is preempted and drafted for."""
    rng = random.Random(seed)
    target = target_prompt(rng)
    with LLM(str(path), **mode, kv_cache_tokens=4096, max_num_batched_tokens=2048) as llm:
        expected = outcome(llm.generate([target], PARAMS)[0])
    preempted = drafted = 0
    for _ in range(cases):
        case = draw_case(rng, target)
        with LLM(str(path), **mode, **case["engine"]) as llm:
            if case["warm_prefix"]:
                llm.generate([target[: len(target) // 2 + 1]], SamplingParams(max_tokens=1))
            out = llm.generate(case["prompts"], PARAMS)[case["position"]]
        assert outcome(out) == expected, case
        preempted += out.metrics.num_preemptions
        drafted += out.metrics.num_draft_tokens
    assert preempted and drafted  # the cases went down those paths


@pytest.mark.parametrize("mode", list(MODES))
def test_request_is_invariant(tiny_checkpoint, mode):
    check_invariant(tiny_checkpoint, MODES[mode], seed=0, cases=6)


@pytest.mark.slow
def test_fast_mode_is_invariant(tiny_checkpoint):
    check_invariant(tiny_checkpoint, dict(quantize="w8a8", compile=True, kv_cache_dtype="float16",
                                          batch_invariant=True), seed=0, cases=6)


@pytest.mark.parametrize(("args", "message"), [
    (dict(device="cuda"), "is for the CPU"),
    (dict(compile=True), "needs quantize='w8a8'"),
    (dict(block_size=48), "needs a block_size that divides 64"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size > 1 is not supported"),
])
def test_refused_where_not_covered(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(batch_invariant=True, **args)
