"""Structured output on llguidance: grammars compiled once per constraint, one matcher per sequence, and a
batch's token bitmasks filled together (why llguidance: scripts/PERFORMANCE.md)."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from minigpt.common.errors import ParamError
from minigpt.sampling.bitmask import bitmask_of, bitmask_words
from minigpt.sampling.structured import StructuredOutputsParams
from minigpt.tokenizer.tokenizer import Tokenizer

# JSON without whitespace between tokens, which a weak model could spend its tokens on
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MISSING_EXTRA = "structured outputs need llguidance: pip install minigpt[structured]"
# In the last quarter of its max_tokens (at least 16 tokens, at most half), a JSON output takes the first closing
# tier its grammar allows, so weak weights still leave JSON that parses: a quote ending a string, brackets, a comma
# ending a number; a schema's members take the tokens they need to close whatever the budget.
MIN_CLOSING_TOKENS = 16
CLOSING_TOKENS_PER_MEMBER = 6  # a schema's member takes up to ~6 tokens to write (`,"`, its name, `":`, a value)
CLOSING_TIERS = (
    lambda text: text[:1] == b'"' and set(text) <= set(b'"]}'),
    lambda text: set(text) <= set(b"]}"),
    lambda text: set(text) == {ord(",")},
)


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.torch
    except ImportError:
        raise ImportError(MISSING_EXTRA) from None
    return llguidance


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = [tokenizer.eos_token_id]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:  # text a grammar forces: a special token's text is text there
        return self._tokenizer.encode_ordinary(text.decode("utf-8", errors="replace"))


class GrammarCompiler:
    """Grammars for one tokenizer: each constraint compiled once (cached by its key), a matcher per sequence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._llg = _llguidance()
        view = _TokenizerView(tokenizer)
        self.tokenizer = self._llg.LLTokenizer(self._llg.TokenizerWrapper(view))
        self.words = bitmask_words(tokenizer.n_vocab)
        self.closing = torch.stack([  # [tiers, words]
            bitmask_of([i for i, text in enumerate(view.tokens) if text and tier(text)], self.words)
            for tier in CLOSING_TIERS
        ])
        self._grammars: dict[str, str] = {}
        self._lock = threading.Lock()  # requests are made in any thread
        self._executor = self._llg.LLExecutor(max(1, torch.get_num_threads()))

    def compile(self, params: StructuredOutputsParams) -> str:
        """llguidance's grammar for `params`; ParamError when it is not valid or fails on its first token.
        Slow for a large grammar: call it off an event loop."""
        key = params.key
        with self._lock:
            grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._grammar(params)
            error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
            if error:
                raise ParamError("StructuredOutputsParams", params.kind, f"is not valid: {error.strip()}")
            error = self._first_token_error(grammar)
            if error:
                raise ParamError("StructuredOutputsParams", params.kind, f"cannot be generated: {error}")
            with self._lock:
                self._grammars[key] = grammar
        return grammar

    def _first_token_error(self, grammar: str) -> str | None:
        """Why a matcher of `grammar` fails on its first mask or token (where llguidance finds its limits)."""
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        mask = matcher.compute_bitmask()
        first = next((i for i, byte in enumerate(mask) if byte), None)
        if matcher.is_error() or first is None:
            return first_line(matcher.get_error()) or "it allows no token"
        token = first * 8 + (mask[first] & -mask[first]).bit_length() - 1
        if not matcher.consume_token(token):
            return first_line(matcher.get_error())
        return None

    def _grammar(self, params: StructuredOutputsParams) -> str:
        m = self._llg.LLMatcher
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else {"type": "object"}
            try:
                return m.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
            except ValueError as err:
                raise ParamError("StructuredOutputsParams", "json", f"is not valid: {err}") from None
        if params.regex is not None:
            return m.grammar_from_regex(params.regex)
        if params.choice is not None:  # Lark string literals are JSON strings
            most = self._llg.LLParserLimits().max_items_in_row - 1  # the parser's row holds every option and one more
            if len(params.choice) > most:
                raise ParamError("StructuredOutputsParams", "choice", f"has {len(params.choice)} options; "
                                 f"llguidance's parser can generate at most {most}")
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
        return m.grammar_from_lark(params.grammar)

    def matcher(self, params: StructuredOutputsParams, max_tokens: int) -> GrammarState:
        closing_window = 0
        if params.json is not None or params.json_object:
            members = CLOSING_TOKENS_PER_MEMBER * _num_members(params.json)
            # the members' need stands; the slack past it takes at most half a budget (else a short max_tokens,
            # /v1/completions' 16, would close every string at its first token)
            closing_window = max(members, min(max(MIN_CLOSING_TOKENS, max_tokens // 4), max_tokens // 2))
        matcher = self._llg.LLMatcher(self.tokenizer, self.compile(params), log_level=0)
        return GrammarState(self, matcher, closing_window)

    def fill(self, states: Sequence[GrammarState], tokens_left: Sequence[int]) -> torch.Tensor:
        """int32 bitmask [len(states), words]: the tokens each state allows next, filled in parallel."""
        bitmask = torch.empty(len(states), self.words, dtype=torch.int32)
        self._llg.torch.fill_next_token_bitmask_par(
            self._executor, [(s.matcher, i) for i, s in enumerate(states)], bitmask)
        rows = torch.tensor([i for i, (s, left) in enumerate(zip(states, tokens_left, strict=True))
                             if left <= s.closing_window], dtype=torch.int64)
        if len(rows):
            closed = bitmask[rows][None] & self.closing[:, None]  # [tiers, rows, words]
            usable = closed.ne(0).any(dim=2)  # [tiers, rows]
            keep = usable.any(dim=0).nonzero().squeeze(1)
            tier = usable.int().argmax(dim=0)  # the first usable tier of each row
            bitmask[rows[keep]] = closed[tier[keep], keep]
        return bitmask


class GrammarState:

    def __init__(self, compiler: GrammarCompiler, matcher: Any, closing_window: int = 0) -> None:
        self.compiler, self.matcher = compiler, matcher
        self.closing_window = closing_window  # tokens left from which a JSON output prefers to close

    def advance(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more (but EOS)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return first_line(self.matcher.get_error())  # the rest is parser state


def first_line(error: str) -> str:
    return error.strip().split("\n", 1)[0]


def _num_members(schema: Any) -> int:
    """How many property names a JSON schema names, at every depth."""
    if isinstance(schema, dict):
        own = len(schema["properties"]) if isinstance(schema.get("properties"), dict) else 0
        return own + sum(_num_members(value) for value in schema.values())
    if isinstance(schema, list):
        return sum(_num_members(value) for value in schema)
    return 0


@functools.lru_cache(maxsize=4)
def compiler_for(tokenizer: Tokenizer) -> GrammarCompiler:
    """One compiler per tokenizer (building llguidance's is slow); a Tokenizer is never modified."""
    return GrammarCompiler(tokenizer)


def fill_bitmask(states: Sequence[GrammarState], tokens_left: Sequence[int]) -> torch.Tensor:
    """int32 bitmask [len(states), words] of the tokens each state allows next (states of one tokenizer)."""
    return states[0].compiler.fill(states, tokens_left)
