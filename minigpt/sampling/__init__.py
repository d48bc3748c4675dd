"""Sampling: what a request asks for, and how the next token of every running sequence is picked.

    params.py      SamplingParams, checked and normalised when built
    structured.py  StructuredOutputsParams: the JSON schema, regex, choice or grammar an output obeys
    bitmask.py     token bitmasks (a grammar's allowed tokens) applied to a batch's logits
    processors.py  the logits processors (bias, allowed ids, penalties, min_tokens, temperature, top-k/p, min-p)
    generator.py   the counter-based random generator: Gumbel noise keyed by (seed, step, id)
    sampler.py     the batched Sampler, the CPU argmax, logprobs
"""

from minigpt.sampling.generator import gumbel_argmax, gumbel_noise, row_keys
from minigpt.sampling.params import GREEDY_BELOW, MAX_LOGPROBS, SamplingParams
from minigpt.sampling.processors import SamplingRow
from minigpt.sampling.sampler import (
    Sampler,
    SamplerOutput,
    TokenLogprobs,
    argmax,
    prompt_logprobs,
)
from minigpt.sampling.structured import StructuredOutputsParams

__all__ = [
    "GREEDY_BELOW",
    "MAX_LOGPROBS",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingRow",
    "StructuredOutputsParams",
    "TokenLogprobs",
    "argmax",
    "gumbel_argmax",
    "gumbel_noise",
    "prompt_logprobs",
    "row_keys",
]
