"""Structured output (`structured_outputs`, `response_format`) on llguidance (`minigpt[structured]`).

    grammar.py  grammars compiled once per constraint, a matcher per sequence, bitmasks per step
    plug.py     structured output plugged into the engine: grammars at request building, a state per sequence,
                the constrained rows of each step sampled under their mask
"""
