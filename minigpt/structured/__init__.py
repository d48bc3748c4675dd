"""Structured output (`structured_outputs`, `response_format`) on llguidance (`minigpt[structured]`).

    grammar.py  grammars compiled once per constraint, a matcher per sequence, bitmasks per step
"""
