"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

lm-evaluation-harness's `local-completions` calls them (its RemoteTokenizer) to count and cut prompts
with the server's own tokenizer; it picks that over loading a Hugging Face tokenizer by the model's name
when /tokenizer_info answers with an `eos_token` and /tokenize with a list of `tokens`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from minigpt.server.errors import check_model, invalid
from minigpt.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    """vLLM's text form of /tokenize (its chat form, `messages`, is not supported)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the BOS token, for a tokenizer that adds one
    return_token_strs: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _no_chat_form(cls, data: Any) -> Any:
        if isinstance(data, dict) and "messages" in data:
            # an APIError, not a ValueError: pydantic passes it on to the app's handler as it is
            raise invalid("only the prompt form of /tokenize is supported (not its chat form, messages)",
                          "messages")
        return data


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class Tokenization:
    """The three endpoints over one tokenizer, serving `model_name` with a context of `max_model_len`."""

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    def tokenize(self, body: TokenizeRequest) -> dict:
        check_model(body.model, self.model_name)
        ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [self.tokenizer.token_text(i) for i in ids]
        return out

    def detokenize(self, body: DetokenizeRequest) -> dict:
        check_model(body.model, self.model_name)
        try:
            return {"prompt": self.tokenizer.decode(body.tokens)}
        except ValueError as err:  # an id outside the vocabulary
            raise invalid(str(err), "tokens") from None

    def tokenizer_info(self) -> dict:
        """vLLM answers with the tokenizer's tokenizer_config.json fields and its class; these are
        transformers' for GPT-2 (<|endoftext|> is BOS, EOS and UNK; no padding token)."""
        tok = self.tokenizer
        eos = tok.token_text(tok.eos_token_id)
        return {
            "tokenizer_class": "GPT2Tokenizer",
            "add_bos_token": tok.bos_token_id is not None,
            "add_prefix_space": False,
            "bos_token": eos if tok.bos_token_id is None else tok.token_text(tok.bos_token_id),
            "eos_token": eos,
            "unk_token": eos,
            "pad_token": None,
            "errors": "replace",
            "model_max_length": self.max_model_len,
        }
