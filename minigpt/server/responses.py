"""The answers' shapes: headers, choices, usage and OpenAI's legacy logprobs of /v1/completions."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from minigpt.engine.request import RequestOutput
from minigpt.sampling import TokenLogprobs
from minigpt.tokenizer.tokenizer import IncrementalDecoder, Tokenizer

if TYPE_CHECKING:
    from minigpt.server.protocol import CompletionRequest, EnginePlan


def completion_body(body: CompletionRequest, plan: EnginePlan, outputs: list[RequestOutput], tokenizer: Tokenizer,
                    model: str, response_id: str) -> dict:
    """The /v1/completions answer: one output per prompt of `plan`."""
    outputs = [replace(out, outputs=out.outputs[: plan.n]) for out in outputs]
    choices = [c for i, out in enumerate(outputs)
               for c in completion_choices(out, i * plan.n, bool(body.echo), tokenizer)]
    return {**header("text_completion", model, response_id), "choices": choices, "usage": usage(outputs)}


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def header(kind: str, model: str, response_id: str) -> dict:
    """What every answer and every chunk opens with; `kind` is OpenAI's `object`."""
    return {"id": response_id, "object": kind, "created": now(), "model": model}


def now() -> int:
    return int(time.time())


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_choices(out: RequestOutput, first_index: int, echo: bool, tokenizer: Tokenizer) -> list[dict]:
    """One prompt's choices, indexed prompt-major (prompt i, sample j -> i * n + j)."""
    prompt_text = prompt_as_text(out, tokenizer) if echo else ""
    choices = []
    for c in out.outputs:
        logprobs = None
        if c.logprobs is not None:
            ids, lps = list(c.token_ids), list(c.logprobs)
            if echo:
                ids, lps = out.prompt_token_ids + ids, list(out.prompt_logprobs) + lps
            logprobs = LogprobsWriter(tokenizer).write(ids, lps)
        choices.append(choice(first_index + c.index, prompt_text + c.text, c.finish_reason, logprobs))
    return choices


def prompt_as_text(out: RequestOutput, tokenizer: Tokenizer) -> str:
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


class LogprobsWriter:
    """OpenAI's legacy logprobs of one choice (the chosen token always in its top_logprobs); a stream writes one
    per chunk, its text_offset running on across them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text_offset = 0
        self._decoder = IncrementalDecoder(tokenizer)

    def write(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            token = token_string(self.tokenizer, token_id)
            tokens.append(token)
            offsets.append(self.text_offset)
            self.text_offset += len(self._decoder.feed(token_id))
            if lp is None:  # a prompt's first token has nothing before it to predict it
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(lp.logprob)
            top = {token_string(self.tokenizer, i): v for i, v in lp.top.items()}
            top.setdefault(token, lp.logprob)
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def token_string(tokenizer: Tokenizer, token_id: int) -> str:
    """A token's text, or OpenAI's "bytes:\\x.." for one that ends inside a UTF-8 character."""
    raw = tokenizer.decode_bytes([token_id])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
