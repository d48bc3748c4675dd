"""vLLM's /tokenize, /detokenize and /tokenizer_info, which lm-eval's RemoteTokenizer calls to count and cut
prompts with the server's own tokenizer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from minigpt.server.chat_template import ChatTemplate, render_messages
from minigpt.server.errors import check_model, invalid
from minigpt.server.protocol import ChatMessage
from minigpt.tokenizer.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt`, or a conversation (`messages`) rendered by the chat template first."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # the chat form's, as in /v1/chat/completions
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = Field(
        None, description="the BOS token, for a tokenizer that adds one (default: true for a prompt, false for "
                          "messages, whose template writes its own)")
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            # an APIError, not a ValueError: pydantic passes it on to the app's handler as it is
            if self.prompt is None:
                raise invalid("prompt is required (or messages, for the chat form)", "prompt")
            raise invalid("give prompt or messages, not both", "messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


class Tokenization:

    def __init__(self, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 template: ChatTemplate | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.template = template

    def tokenize(self, body: TokenizeRequest) -> dict:
        check_model(body.model, self.model_name)
        text, add_special_tokens = body.prompt, body.add_special_tokens
        if body.messages is not None:
            text = render_messages(self.template, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
        if add_special_tokens is None:
            add_special_tokens = body.messages is None
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
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
        """vLLM's answer: the tokenizer_config.json fields transformers has for GPT-2."""
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
