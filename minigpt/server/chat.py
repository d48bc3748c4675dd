"""/v1/chat/completions: messages rendered by the chat template, then run through /v1/completions' mapping, so
both endpoints accept and refuse the same values."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from minigpt.async_llm.request_handle import RequestHandle, StreamDelta
from minigpt.common.errors import ParamError
from minigpt.engine.input_processor import check_context
from minigpt.engine.request import RequestOutput
from minigpt.sampling import TokenLogprobs
from minigpt.server.chat_template import ChatTemplate, render_messages
from minigpt.server.completions import CompletionServer
from minigpt.server.errors import check_model, invalid
from minigpt.server.protocol import ChatMessage, CompletionRequest, EnginePlan, SamplingFields
from minigpt.server.responses import chat_completion_id, header, usage
from minigpt.server.streams import event_stream
from minigpt.tokenizer.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20  # OpenAI's bound


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, description="default: the rest of the context")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template")

    def completion(self, prompt: list[int], context: int) -> CompletionRequest:
        """The completions request this one amounts to, for the prompt's ids and a context of `context` tokens."""
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:  # the default: the rest of the context
            try:
                max_tokens = check_context(len(prompt), None, context)
            except ParamError:
                raise invalid(f"the messages make a prompt of {len(prompt)} tokens, which leaves no room in the "
                              f"model's context of {context} tokens", "messages") from None
        fields = {name: getattr(self, name) for name in SamplingFields.model_fields}  # passed on unchanged
        return CompletionRequest.model_construct(
            prompt=prompt, max_tokens=max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None, **fields)


def chat_plan(body: ChatCompletionRequest, template: ChatTemplate | None, tokenizer: Tokenizer,
              context: int) -> EnginePlan:
    """The engine request a chat body asks for; a 400 for a body the engine cannot run."""
    text = render_messages(template, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    prompt = tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS
    if not prompt:
        raise invalid("the chat template rendered the messages as an empty prompt", "messages")
    completion = body.completion(prompt, context)
    renames = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}
    params = completion.sampling_params(renames)
    completion.prompts()  # the request-size checks of /v1/completions
    return EnginePlan([prompt], params, params.n, replace(completion.field_names(renames), prompt="messages"))


def chat_body(body: ChatCompletionRequest, out: RequestOutput, tokenizer: Tokenizer, model: str,
              response_id: str) -> dict:
    top = body.top_logprobs or 0
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": None if c.logprobs is None else chat_logprobs(tokenizer, c.token_ids, c.logprobs, top),
                "finish_reason": c.finish_reason} for c in out.outputs]
    return {**header("chat.completion", model, response_id), "choices": choices, "usage": usage([out])}


class ChatServer:
    def __init__(self, completions: CompletionServer, template: ChatTemplate | None) -> None:
        self.completions = completions
        self.template = template

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response | dict:
        server = self.completions
        check_model(body.model, server.model_name)
        context = server.llm.engine.model_config.n_positions
        # rendering may loop for long: off the event loop
        plan = await asyncio.to_thread(chat_plan, body, self.template, server.llm.tokenizer, context)
        handles = await server.submit(plan)
        if body.stream:
            return self._stream(handles, plan.n, body.top_logprobs or 0, body.include_usage)
        outputs = await server.outputs(request, handles)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        return chat_body(body, outputs[0], server.llm.tokenizer, server.model_name, chat_completion_id())

    def _stream(self, handles: list[RequestHandle], n: int, top: int, include_usage: bool) -> Response:
        tokenizer = self.completions.llm.tokenizer

        def chunk(_: int, delta: StreamDelta) -> dict | None:
            logprobs = None
            if delta.logprobs is not None and delta.token_ids:
                logprobs = chat_logprobs(tokenizer, delta.token_ids, delta.logprobs, top)
            if delta.text or delta.finished or logprobs is not None:
                content = {"content": delta.text} if delta.text else {}
                return chunk_choice(delta.index, content, delta.finish_reason, logprobs)
            return None

        opening = [chunk_choice(index, {"role": "assistant", "content": ""}) for index in range(n)]
        head = header("chat.completion.chunk", self.completions.model_name, chat_completion_id())
        return event_stream(handles, head, include_usage, opening, chunk)


def chunk_choice(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], top: int) -> dict:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the `top` most likely tokens."""

    def entry(token_id: int, logprob: float) -> dict:
        raw = tokenizer.decode_bytes([token_id])
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        ranked = sorted(lp.top.items(), key=lambda item: -item[1])[:top]
        content.append({**entry(token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in ranked]})
    return {"content": content}
