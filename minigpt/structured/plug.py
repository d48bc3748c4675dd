"""Structured outputs plugged into the engine: grammars compiled as requests are built, the sampler's mask."""

from __future__ import annotations

from collections.abc import Callable

from minigpt.engine.engine import Engine
from minigpt.engine.seams import Step
from minigpt.sampling import GrammarMask, SamplingParams
from minigpt.structured.grammar import GrammarState, compiler_for, fill_bitmask
from minigpt.tokenizer.tokenizer import Tokenizer


def plug_structured_outputs(engine: Engine) -> None:
    engine.inputs.grammars = Grammars(engine.tokenizer)
    engine.steps.append(grammar_mask)


class Grammars:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def prepare(self, params: SamplingParams) -> Callable[[], GrammarState]:
        """Compile the constraint now (a bad one raises ValueError); returns a maker of one state per sequence."""
        compiler = compiler_for(self.tokenizer)  # llguidance loads with the first constraint
        constraint = params.structured_outputs
        compiler.compile(constraint)
        return lambda: compiler.matcher(constraint, params.max_tokens)


def grammar_mask(step: Step) -> None:
    """The tokens each structured-output sequence's grammar allows next, in the sampler's rows."""
    if all(seq.grammar is None for seq in step.seqs):
        return
    rows, states, left = [], [], []
    for seq, span in step.spans():
        if seq.grammar is not None:
            rows.append(span.start)
            states.append(seq.grammar)
            left.append(seq.max_len - len(seq.token_ids))
    if rows:
        step.grammar = GrammarMask(rows, fill_bitmask(states, left))
