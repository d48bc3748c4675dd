"""Same request, same bits: a request's token ids, logprobs and prompt logprobs are bitwise the same
whatever it is batched with, however its prompt is chunked, whether its prefix came from the cache,
whether it was preempted and recomputed, and whether speculation drafted for it.

Each mode that promises it (docs/batch-invariance.md) runs a few cases drawn by a seeded
`random.Random`: the target prompt alone in an engine that neither chunks nor preempts, then among
random others of random lengths, with a random step budget (chunked prefill), a pool small enough to
preempt, others sharing its prefix and an earlier request of its prefix (prefix-cache hits: then without
prompt logprobs, which compute every prompt position) and n-gram speculation.
"""

from __future__ import annotations

import random

import pytest

from minigpt import LLM, SamplingParams
from minigpt.engine.config import BatchInvariance, EngineConfig

N_POSITIONS = 128
MAX_TOKENS = 24
PARAMS = {scored: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True,
                                 prompt_logprobs=3 if scored else None) for scored in (True, False)}
VOCAB = 50257

FAST_MODE = dict(quantize="w8a8", compile=True, kv_cache_dtype="float16")  # invariant without asking
MODES = {
    "fast mode": FAST_MODE,
    "w8a8": dict(quantize="w8a8", batch_invariant=True),
    "float32": dict(batch_invariant=True),
    "bfloat16": dict(dtype="bfloat16", batch_invariant=True),
}


def outcome(out) -> tuple:
    """Everything about one output that must not move: token ids, logprobs with their alternatives,
    prompt logprobs (floats compared as floats: equal means bitwise here, no NaN can appear)."""
    def logprobs(entries):
        return None if entries is None else [None if e is None else (e.logprob, sorted(e.top.items())) for e in entries]

    return out.token_ids, logprobs(out.logprobs), logprobs(out.prompt_logprobs)


def draw_case(rng: random.Random, target: list[int], n_positions: int = N_POSITIONS) -> dict:
    """Random company for `target`: others of random lengths (some sharing its prefix), a step budget,
    a pool size, speculation or not."""
    others = []
    for _ in range(rng.randrange(1, 6)):
        length = rng.randrange(1, n_positions - MAX_TOKENS)
        prompt = [rng.randrange(VOCAB) for _ in range(length)]
        if rng.random() < 0.4:  # shares the target's first blocks
            shared = rng.randrange(1, len(target))
            prompt = target[:shared] + prompt[: max(1, length - shared)]
        others.append(prompt)
    position = rng.randrange(len(others) + 1)
    return {
        "prompts": others[:position] + [target] + others[position:],
        "position": position,
        "warm_prefix": rng.random() < 0.5,  # the target's prefix cached by an earlier request
        "scored": rng.random() < 0.3,  # prompt logprobs: no prefix-cache hits
        "engine": {
            "max_num_batched_tokens": rng.choice([8, 16, 33, 64, 2048]),
            "kv_cache_tokens": rng.choice([n_positions, 2 * n_positions, 8 * n_positions]),  # the small ones preempt
            "speculative_config": rng.choice([None, {"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_max": 3, "prompt_lookup_min": 1}]),
        },
    }


def target_prompt(rng: random.Random, n_positions: int = N_POSITIONS) -> list[int]:
    """A prompt whose n-grams repeat, so that n-gram speculation drafts for it."""
    motif = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 8))]
    return (motif * n_positions)[: rng.randrange(20, n_positions - MAX_TOKENS - 8)]


def check_invariant(path, mode: dict, seed: int, cases: int, n_positions: int = N_POSITIONS) -> None:
    """`cases` random cases against the target alone; among them, the target is preempted, drafted for and
    served from the prefix cache."""
    rng = random.Random(seed)
    target = target_prompt(rng, n_positions)
    with LLM(str(path), **mode, kv_cache_tokens=8 * n_positions, max_num_batched_tokens=2048) as llm:
        expected = {scored: outcome(llm.generate([target], params)[0]) for scored, params in PARAMS.items()}
    preempted = drafted = cached = 0
    for _ in range(cases):
        case = draw_case(rng, target, n_positions)
        with LLM(str(path), **mode, **case["engine"]) as llm:
            if case["warm_prefix"]:
                llm.generate([target[: len(target) // 2 + 1]], SamplingParams(max_tokens=1))
            hits = llm.engine.blocks.num_hit_blocks
            out = llm.generate(case["prompts"], PARAMS[case["scored"]])[case["position"]]
            cached += llm.engine.blocks.num_hit_blocks - hits
        assert outcome(out) == expected[case["scored"]], case
        preempted += out.metrics.num_preemptions
        drafted += out.metrics.num_draft_tokens
    assert preempted and drafted and cached  # the cases went down those paths


@pytest.mark.parametrize("mode", list(MODES))
def test_request_is_invariant(tiny_checkpoint, mode):
    check_invariant(tiny_checkpoint, MODES[mode], seed=0, cases=6)


@pytest.mark.slow
def test_fast_mode_is_invariant_on_long_prompts(checkpoint_factory):
    """Prompts of hundreds of tokens, where one attention call over a whole chunk gives a row other bits than
    the same row in other chunks (tests/test_kernels.py)."""
    check_invariant(checkpoint_factory(n_positions=1024), FAST_MODE, seed=1, cases=4, n_positions=640)


def test_fast_mode_says_it_is_invariant():
    assert EngineConfig(**FAST_MODE).invariance.holds and not EngineConfig(quantize="w8a8").invariance.holds
    assert EngineConfig(quantize="w8a8", batch_invariant=True).invariance.holds


def test_invariance_is_decided_in_one_place():
    """What each mode turns on: the invariant attention, tiled float linears, and what the server reports."""
    assert EngineConfig().invariance == BatchInvariance(attention=False, tiled_linears=False, holds=False)
    assert EngineConfig(batch_invariant=True).invariance == BatchInvariance(True, True, True)
    assert EngineConfig(batch_invariant=True, quantize="w8a8").invariance == BatchInvariance(True, False, True)
    assert EngineConfig(**FAST_MODE).invariance == BatchInvariance(attention=False, tiled_linears=False, holds=True)


@pytest.mark.parametrize(("args", "message"), [
    (dict(device="cuda"), "is for the CPU"),
    (dict(compile=True), "needs quantize='w8a8'"),
    (dict(block_size=48), "needs a block_size that divides 64"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size > 1 is not supported"),
])
def test_refused_where_not_covered(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(batch_invariant=True, **args)
