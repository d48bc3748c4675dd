"""What `speculative_config` may say, checked when the engine config is built (speculative/ runs it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
_KEYS = {
    "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive"},
    "draft_model": {"method", "num_speculative_tokens", "model", "adaptive"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: tokens drafted per step, at most
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the context
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # draft_model: hub id or checkpoint directory
    adaptive: bool = True  # adapt k per sequence to its acceptance (False: always k, as measurements want)

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig:
        """The config a `speculative_config` dict describes; raises ValueError naming a bad key or value."""
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or None), got {type(value).__name__}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
        unknown = set(value) - _KEYS[method]
        if unknown:
            raise ValueError(f"speculative_config has key(s) {sorted(unknown)} that method {method!r} does not take "
                             f"(it takes {sorted(_KEYS[method])})")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config['num_speculative_tokens'] is required")
        config = cls(**value)
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            number = getattr(config, name)
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"speculative_config['{name}'] must be an integer >= 1, got {number!r}")
        if not isinstance(config.adaptive, bool):
            raise ValueError(f"speculative_config['adaptive'] must be true or false, got {config.adaptive!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config['prompt_lookup_min']={config.prompt_lookup_min} is more than "
                             f"prompt_lookup_max={config.prompt_lookup_max}")
        if method == "draft_model" and (not isinstance(config.model, str) or not config.model):
            raise ValueError(f"speculative_config['model'] must name the draft checkpoint, got {config.model!r}")
        return config
