"""Structured outputs plugged into the engine: grammars compiled as requests are built, a state for each of their
sequences, and the constrained sequences' rows of every step sampled under their grammars' mask."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from operator import attrgetter

from minigpt.engine.engine import Engine
from minigpt.engine.seams import Step
from minigpt.engine.sequence import Sequence
from minigpt.sampling import SamplingParams
from minigpt.structured.grammar import GrammarState, compiler_for, fill_bitmask
from minigpt.tokenizer.tokenizer import Tokenizer

States = weakref.WeakKeyDictionary  # Sequence -> GrammarState: one ended elsewhere (aborted, failed) goes with it
_constraint = attrgetter("params.structured_outputs")  # a sequence's, or None: its state is in States


def plug_structured_outputs(engine: Engine) -> None:
    states: States[Sequence, GrammarState] = States()
    engine.inputs.grammars = Grammars(engine.tokenizer, states)
    engine.postprocessors.append(GrammarPostprocessor(engine, states))


class Grammars:
    def __init__(self, tokenizer: Tokenizer, states: States[Sequence, GrammarState]) -> None:
        self.tokenizer, self.states = tokenizer, states

    def prepare(self, params: SamplingParams) -> Callable[[Sequence], None]:
        """Compile the constraint now (a bad one raises ValueError); returns what gives a sequence its state."""
        compiler = compiler_for(self.tokenizer)  # llguidance loads with the first constraint
        constraint = params.structured_outputs
        compiler.compile(constraint)

        def attach(seq: Sequence) -> None:
            self.states[seq] = compiler.matcher(constraint, params.max_tokens)

        return attach


class GrammarPostprocessor:
    """Takes the constrained sequences' rows out of a step (one row each: the speculator drafts none for a
    structured output), samples them under the tokens their grammars allow and advances each grammar by the
    token its sequence appends."""

    def __init__(self, engine: Engine, states: States[Sequence, GrammarState]) -> None:
        self.engine, self.states = engine, states

    def acts_on(self, step: Step) -> bool:
        return bool(self.states) and any(map(_constraint, step.seqs))  # C loops: every step of every engine asks

    def __call__(self, step: Step) -> None:
        if not self.acts_on(step):
            return
        seqs, rows = step.take(_constraint)
        engine, states = self.engine, [self.states[seq] for seq in seqs]
        bitmask = fill_bitmask(states, [seq.max_len - len(seq.token_ids) for seq in seqs])
        out = engine.sampler(step.logits[engine.device_rows(rows)], seqs, bitmask)
        logprobs = out.logprobs or [None] * len(seqs)
        for seq, state, token, token_logprobs in zip(seqs, states, out.token_ids, logprobs, strict=True):
            if state.advance(token):
                seq.append(token, token_logprobs, last=state.complete)
            else:
                seq.refuse(token, token_logprobs,
                           f"token {token} does not fit the structured output's grammar: {state.error}")
            if seq.finished:
                del self.states[seq]
                engine.finish(seq)
