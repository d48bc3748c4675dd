"""Speculative decoding: cheap drafts of the next tokens, verified by the target in one forward.

    ngram.py       prompt lookup: the tokens that followed the context's ending earlier on
    draft.py       a draft model with its own runner, KV pool and block tables
    speculator.py  drafts for the step's decodes, k adapted per sequence to its acceptance; the engine's seam
    verify.py      the rows the target verifies and the drafts it accepts (rejection sampling)
"""

from minigpt.speculative.speculator import Speculator

__all__ = ["Speculator"]
