"""Structured outputs plugged into the engine: grammars compiled as requests are built, the sampler's mask."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from minigpt.engine.engine import Engine
from minigpt.engine.seams import Step
from minigpt.sampling import GrammarMask, SamplingParams
from minigpt.structured.grammar import GrammarState, compiler_for, fill_bitmask
from minigpt.tokenizer.tokenizer import Tokenizer


def plug_structured_outputs(engine: Engine) -> None:
    engine.inputs.grammars = Grammars(engine.tokenizer)
    engine.postprocessors.append(GrammarMasker())


class Grammars:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def prepare(self, params: SamplingParams) -> Callable[[], GrammarState]:
        """Compile the constraint now (a bad one raises ValueError); returns a maker of one state per sequence."""
        compiler = compiler_for(self.tokenizer)  # llguidance loads with the first constraint
        constraint = params.structured_outputs
        compiler.compile(constraint)
        return lambda: compiler.matcher(constraint, params.max_tokens)


_grammar = attrgetter("grammar")  # a GrammarState (truthy) or None


class GrammarMasker:
    """The tokens each structured-output sequence's grammar allows next, in the sampler's rows."""

    def acts_on(self, step: Step) -> bool:
        return any(map(_grammar, step.seqs))  # a C loop: every step of every engine asks

    def __call__(self, step: Step) -> None:
        if self.acts_on(step):
            step.grammar = grammar_mask(step)


def grammar_mask(step: Step) -> GrammarMask:
    rows, states, left = [], [], []
    for seq, span in step.spans():
        if seq.grammar is not None:
            rows.append(span.start)
            states.append(seq.grammar)
            left.append(seq.max_len - len(seq.token_ids))
    return GrammarMask(rows, fill_bitmask(states, left))
