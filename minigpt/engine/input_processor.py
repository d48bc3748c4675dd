"""Requests checked and built: a prompt's ids, its params against this engine's vocabulary, context and pool."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from typing import Any, Protocol

from minigpt.common.errors import Named, ParamError
from minigpt.engine.config import EngineConfig
from minigpt.engine.kv_cache import BlockManager
from minigpt.engine.request import EngineRequest, Prompt, Request
from minigpt.engine.sequence import Sequence
from minigpt.sampling import SamplingParams
from minigpt.tokenizer.tokenizer import Tokenizer


class Grammars(Protocol):
    """Structured outputs, plugged in from above the engine."""

    def prepare(self, params: SamplingParams) -> Callable[[Sequence], None]:
        """Compile params.structured_outputs (ValueError for a bad one); returns what gives a sequence its state."""


def check_context(prompt_len: int, max_tokens: int | None, n_positions: int) -> int:
    """The one check of a request's length against the model's context: its max_tokens (None: the rest of the
    context); ParamError (on the prompt) when it does not fit."""
    if max_tokens is None:
        if prompt_len >= n_positions:
            raise ParamError("", "prompt", ("a ", Named("prompt"), f" of {prompt_len} tokens leaves no room in the "
                                            f"model's context of {n_positions} tokens"))
        return n_positions - prompt_len
    if prompt_len + max_tokens > n_positions:
        raise ParamError("", "prompt", (Named("prompt"), f" of {prompt_len} tokens + ", Named("max_tokens", max_tokens),
                                        f" exceeds the model's context of {n_positions} tokens (n_positions)"))
    return max_tokens


class InputProcessor:
    """Builds a request of the kind its params say: SamplingParams here, more kinds registered by features."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, vocab_limit: int, eos_token_ids: tuple[int, ...],
                 n_positions: int, blocks: BlockManager, pool_tokens: int) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.vocab_limit, self.eos_token_ids, self.n_positions = vocab_limit, eos_token_ids, n_positions
        self.blocks, self.pool_tokens = blocks, pool_tokens
        self.builders: dict[type, Callable[[Prompt, Any], EngineRequest]] = {SamplingParams: self.sampled_request}
        self.grammars: Grammars | None = None
        self._ids = itertools.count()  # next() is atomic: requests are made in any thread

    def register(self, kind: type, builder: Callable[[Prompt, Any], EngineRequest]) -> None:
        self.builders[kind] = builder

    def make_request(self, prompt: Prompt, params: Any, kind: type | None = None) -> EngineRequest:
        """The request `params` asks for (`kind`: the one params type the caller takes)."""
        kinds = [kind] if kind is not None else list(self.builders)
        for known in kinds:
            if isinstance(params, known) and known in self.builders:
                return self.builders[known](prompt, params)
        names = " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"params must be {names}, got {type(params).__name__}")

    def sampled_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        params = replace(params)  # checked again (a field set after construction) and the request's own copy
        text, ids = self.prompt_ids(prompt)
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= self.vocab_limit]
            if bad:
                raise ParamError("SamplingParams", name,
                                 f"has token id {bad[0]}, outside the vocabulary [0, {self.vocab_limit})")
        self._check_stop(params.stop)
        held_back = {*params.stop_token_ids, *self.eos_token_ids}  # what min_tokens suppresses
        if params.min_tokens and params.allowed_token_ids and held_back.issuperset(params.allowed_token_ids):
            raise ParamError("SamplingParams", "allowed_token_ids", f"holds only stop or EOS ids, which "
                             f"min_tokens={params.min_tokens} holds back: no token could be picked")
        check_context(len(ids), params.max_tokens, self.n_positions)
        needed = len(ids) + params.max_tokens
        if self.blocks.blocks_needed(needed) > self.blocks.num_blocks:
            raise ValueError(f"the KV pool holds {self.pool_tokens} tokens but this request needs {needed}; "
                             "raise kv_cache_tokens")
        attach_grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("this engine has no structured outputs plugged in")
            attach_grammar = self.grammars.prepare(params)  # a bad grammar is refused here
        request = Request(next(self._ids), text, ids, params)
        base_seed = params.seed if params.seed is not None else random.getrandbits(62)
        for i in range(params.n):
            seed = (base_seed + i * 0x9E3779B97F4A7C15) & (2**63 - 1)
            seq = Sequence(request.request_id, ids, params, seed, self.tokenizer, self.eos_token_ids, self.n_positions)
            if attach_grammar is not None:
                attach_grammar(seq)
            request.seqs.append(seq)
        return request

    def prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                prompt.encode()  # a lone surrogate (JSON's "\ud800") is no text: no output could echo it
            except UnicodeEncodeError as err:
                raise ValueError(f"prompt is not valid Unicode: U+{ord(prompt[err.start]):04X} at character "
                                 f"{err.start} ({err.reason})") from None
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif (isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray))
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            text, ids = None, list(prompt)
        else:
            raise TypeError("a prompt must be a string or a list of token ids as Python ints (arrays: .tolist(), "
                            "bytes: .decode())")
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:  # text too: a tokenizer may know more ids than the model has rows
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_limit})")
        return text, ids

    def _check_stop(self, stop: tuple[str, ...]) -> None:
        config = self.config
        if len(stop) > config.max_stop_strings:
            raise ParamError("SamplingParams", "stop", f"has {len(stop)} strings; this engine takes at most "
                             f"{config.max_stop_strings} (max_stop_strings)")
        chars = sum(map(len, stop))
        if chars > config.max_stop_chars:
            raise ParamError("SamplingParams", "stop", f"holds {chars} characters; this engine takes at most "
                             f"{config.max_stop_chars} in all (max_stop_chars)")
