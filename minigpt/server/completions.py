"""/v1/completions and /v1/models over one AsyncLLM: each prompt one engine request, cancelled (its KV blocks
freed) when its client leaves a stream or a wait."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from minigpt.async_llm.async_engine import AsyncLLM
from minigpt.async_llm.request_handle import RequestHandle, StreamDelta
from minigpt.common import cpu_class
from minigpt.engine.request import RequestOutput
from minigpt.server.errors import check_model
from minigpt.server.protocol import CompletionRequest, EnginePlan, completion_plan
from minigpt.server.responses import LogprobsWriter, choice, completion_body, completion_id, header, now
from minigpt.server.streams import event_stream, unless_disconnected
from minigpt.server.submit import failure, submit_plan


class CompletionServer:
    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.created = now()
        # the kernels' class: a batch-invariant engine's bits hold for one class (docs/batch-invariance.md)
        self.cpu_class = cpu_class.describe() if str(llm.engine.config.device).startswith("cpu") else None

    async def models(self) -> dict:
        return {"object": "list", "data": [self._card()]}

    async def model(self, model: str) -> dict:
        """OpenAI's retrieve: the served model's card, a 404 for any other name (none: the list)."""
        if not model:  # /v1/models/
            return await self.models()
        check_model(model, self.model_name)
        return self._card()

    def _card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "minigpt",
                "max_model_len": self.llm.engine.model_config.n_positions,
                "batch_invariant": self.llm.engine.config.invariance.holds, "cpu_class": self.cpu_class}

    async def completions(self, body: CompletionRequest, request: Request) -> Response | dict:
        check_model(body.model, self.model_name)
        plan = completion_plan(body)
        handles = await self.submit(plan)
        if body.stream:  # (beam search refuses stream)
            return self._stream(handles, plan, bool(body.echo), body.include_usage)
        outputs = await self.outputs(request, handles)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        return completion_body(body, plan, outputs, self.llm.tokenizer, self.model_name, completion_id())

    async def submit(self, plan: EnginePlan) -> list[RequestHandle]:
        """`submit_plan` off the event loop; the requests of a client that left meanwhile are cancelled."""
        made = asyncio.get_running_loop().run_in_executor(None, submit_plan, self.llm, plan)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            made.add_done_callback(_cancel_handles)
            raise

    async def outputs(self, request: Request, handles: list[RequestHandle]) -> list[RequestOutput] | None:
        """The requests' outputs; None (the requests cancelled) when the client leaves first; a 500 for a failure."""
        try:
            outputs = await unless_disconnected(request, asyncio.gather(*(h.wait() for h in handles)))
        finally:
            for handle in handles:
                handle.cancel()  # a no-op for finished requests
        error = failure(handles) if outputs is not None else None
        if error is not None:
            raise error
        return outputs

    def _stream(self, handles: list[RequestHandle], plan: EnginePlan, echo: bool, include_usage: bool) -> Response:
        """A chunk per delta of any choice: its text, and its tokens' logprobs even while their text is held back."""
        n, tokenizer = plan.n, self.llm.tokenizer
        opening = [choice(i * n + j, prompt if isinstance(prompt, str) else tokenizer.decode(prompt), None)
                   for i, prompt in enumerate(plan.prompts if echo else []) for j in range(n)]
        writers: dict[int, LogprobsWriter] = {}  # by choice index

        def chunk(i: int, delta: StreamDelta) -> dict | None:
            index, logprobs = i * n + delta.index, None
            if delta.logprobs is not None and delta.token_ids:
                if index not in writers:
                    writers[index] = LogprobsWriter(tokenizer)
                logprobs = writers[index].write(delta.token_ids, delta.logprobs)
            if delta.text or delta.finished or logprobs is not None:
                return choice(index, delta.text, delta.finish_reason, logprobs)
            return None

        head = header("text_completion", self.model_name, completion_id())
        return event_stream(handles, head, include_usage, opening, chunk)


def _cancel_handles(made: asyncio.Future) -> None:
    if not made.cancelled() and made.exception() is None:
        for handle in made.result():
            handle.cancel()
