"""GPT2Config: the fields of a GPT-2 `config.json` that change the math, with transformers' defaults; what
minigpt cannot run faithfully is refused here."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from minigpt.model.activations import ACTIVATIONS

# HF aliases that some fine-tunes write instead of GPT-2's own names.
_ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
    "n_ctx": "n_positions",
}


class ConfigError(ValueError):
    """A config.json that minigpt cannot run faithfully."""


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | tuple[int, ...] | None = 50256  # several: generation ends at any of them

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"config.json: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner < 1):
            raise ConfigError(f"config.json: n_inner must be a positive integer or null, got {self.n_inner!r}")
        # isinstance first: a JSON list or object is unhashable, and `in` a dict would raise TypeError
        if not isinstance(self.activation_function, str) or self.activation_function not in ACTIVATIONS:
            raise ConfigError(
                f"config.json: activation_function {self.activation_function!r} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        if not self.layer_norm_epsilon > 0:
            raise ConfigError(f"config.json: layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")
        self.eos_token_ids  # noqa: B018 (raises on ids that are not ints)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id of config.json's eos_token_id (one id or a list)."""
        return _id_tuple(self.eos_token_id, "config.json: eos_token_id")

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def attention_scale(self, layer_idx: int) -> float:
        """The factor applied to q @ k^T in layer `layer_idx` (as transformers computes it)."""
        scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        return scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GPT2Config:
        model_type = raw.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ConfigError(f"config.json: model_type {model_type!r} is not GPT-2; minigpt runs only 'gpt2'")
        if raw.get("add_cross_attention"):
            raise ConfigError("config.json: add_cross_attention=true (encoder-decoder GPT-2) is not supported")
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = _ALIASES.get(key, key)
            if name in known and (key == name or name not in raw):
                values[name] = value
        eos = values.get("eos_token_id")
        if isinstance(eos, list):
            values["eos_token_id"] = tuple(eos) if len(eos) > 1 else eos[0] if eos else None
        return cls(**values)

    @classmethod
    def from_json_file(cls, path: str | Path) -> GPT2Config:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
        out.update({f.name: getattr(self, f.name) for f in fields(self)})
        out["n_ctx"] = self.n_positions
        return out


def _id_tuple(value: Any, what: str) -> tuple[int, ...]:
    ids = () if value is None else (value,) if isinstance(value, int) else value
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{what} must be a token id, a list of them or null, got {value!r}")
    return tuple(ids)


def eos_token_ids(checkpoint_dir: str | Path, config: GPT2Config) -> tuple[int, ...]:
    """generation_config.json's when it names them (as transformers' `generate`), else config.json's."""
    path = Path(checkpoint_dir) / "generation_config.json"
    if path.exists():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path} is not valid JSON: {err}") from None
        if isinstance(raw, dict) and "eos_token_id" in raw:
            return _id_tuple(raw["eos_token_id"], f"{path.name}: eos_token_id")
    return config.eos_token_ids
