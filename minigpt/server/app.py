"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models[/{model}], vLLM's
/tokenize, /detokenize and /tokenizer_info, plus /health and /metrics.

Each prompt of a request becomes one `AsyncLLM` request, so it joins the running batch at the
engine's next step. A request ends when the engine finishes it or when its client goes away:
leaving a stream (Starlette cancels the generator when the client disconnects) or a wait
(a watcher task sees `http.disconnect`) cancels the engine request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minigpt.common.version import __version__
from minigpt.engine.request import RequestOutput
from minigpt.sampling import SamplingParams
from minigpt.server import protocol
from minigpt.server.chat import ChatServer
from minigpt.server.chat_template import ChatTemplate
from minigpt.server.errors import APIError, check_model, install_handlers
from minigpt.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT
from minigpt.server.middleware import BearerAuth, BodyLimits, check_api_key
from minigpt.server.protocol import CompletionRequest
from minigpt.server.streams import event, merged, unless_disconnected
from minigpt.server.submit import failure, submit_plan
from minigpt.server.tokenization import Tokenization
from minigpt.serving.async_engine import AsyncLLM
from minigpt.serving.request_handle import RequestHandle

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


def build_app(
    llm: AsyncLLM, model_name: str, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    chat_template: ChatTemplate | None = None, read_timeout: float = DEFAULT_READ_TIMEOUT,
) -> FastAPI:
    """An app serving `llm` under `model_name`; with `api_key`, /v1 and the tokenizer endpoints ask for
    `Authorization: Bearer <key>` (ValueError for a key no client can send: empty, spaces, not ASCII).
    Without `chat_template`, /v1/chat/completions answers 400. A body must arrive within `read_timeout` seconds."""
    if api_key is not None:
        check_api_key(api_key)
    app = FastAPI(title="minigpt", version=__version__)
    install_handlers(app)
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes, timeout=read_timeout)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key, prefix=("/v1", *TOKENIZER_PATHS))  # added last: runs first
    server = CompletionServer(llm, model_name)
    v1 = APIRouter(prefix="/v1")
    v1.add_api_route("/completions", server.completions, methods=["POST"], response_model=None)
    v1.add_api_route("/chat/completions", ChatServer(server, chat_template).chat_completions, methods=["POST"],
                     response_model=None)
    v1.add_api_route("/models", server.models, methods=["GET"])
    v1.add_api_route("/models/{model:path}", server.model, methods=["GET"])  # a served name may hold slashes
    app.include_router(v1)
    # vLLM's paths: at the root, where lm-eval looks for them beside <root>/v1/completions
    tokenization = Tokenization(llm.tokenizer, model_name, llm.engine.model_config.n_positions, chat_template)
    app.add_api_route("/tokenize", tokenization.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", tokenization.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenization.tokenizer_info, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine can serve; else 503 with the reason (an orchestrator restarts the server)."""
        problem = llm.problem()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(llm.metrics().to_prometheus(), media_type=PROMETHEUS_TEXT)

    return app


class CompletionServer:
    """The /v1 endpoints over one AsyncLLM."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.created = protocol.now()

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
                "batch_invariant": self.llm.engine.config.batch_invariant}  # README, "Batch invariance"

    async def completions(self, body: CompletionRequest, request: Request) -> Response | dict:
        check_model(body.model, self.model_name)
        plan = protocol.completion_plan(body)
        handles = await self.submit(plan)
        if body.stream:  # (beam search refuses stream)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._stream(handles, plan.prompts, plan.params, bool(body.echo), include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            outputs = await unless_disconnected(request, asyncio.gather(*(h.wait() for h in handles)))
        finally:
            for handle in handles:
                handle.cancel()  # a no-op for finished requests
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        self.raise_failures(handles)
        return protocol.completion_body(body, plan, outputs, self.llm.tokenizer, self.model_name,
                                        protocol.completion_id())

    async def submit(self, plan: protocol.EnginePlan) -> list[RequestHandle]:
        """`submit_plan` in a worker thread: tokenizing long prompts and compiling a grammar (up to seconds) never
        hold the event loop; requests made for a client that left meanwhile are cancelled."""
        made = asyncio.get_running_loop().run_in_executor(None, submit_plan, self.llm, plan)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            made.add_done_callback(_cancel_handles)
            raise

    @staticmethod
    def raise_failures(handles: list[RequestHandle]) -> None:
        error = failure(handles)
        if error is not None:
            raise error

    def _header(self) -> dict:
        return protocol.header("text_completion", self.model_name, protocol.completion_id())

    async def _stream(self, handles: list[RequestHandle], prompts: list[protocol.Prompt], params: SamplingParams,
                      echo: bool, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: one chunk per delta of any choice (its text, and with logprobs those of its
        tokens, even while their text is held back), then usage if asked, then [DONE]."""
        header = self._header()  # every chunk of a completion shares its id and created time
        if include_usage:  # OpenAI: every chunk carries usage, null until the last
            header["usage"] = None
        n, tokenizer = params.n, self.llm.tokenizer
        writers: dict[int, protocol.LogprobsWriter] = {}  # by choice index, when logprobs are asked for
        try:
            if echo:
                for i, prompt in enumerate(prompts):
                    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
                    for j in range(n):
                        yield event({**header, "choices": [protocol.choice(i * n + j, text, None)]})
            async for i, delta in merged(handles):
                if delta.finish_reason == "error":
                    error = APIError(500, f"generation failed: {handles[i].error or 'engine error'}", "server_error")
                    yield event(error.body())
                    continue
                index = i * n + delta.index
                logprobs = None
                if delta.logprobs is not None and delta.token_ids:
                    if index not in writers:
                        writers[index] = protocol.LogprobsWriter(tokenizer)
                    logprobs = writers[index].write(delta.token_ids, delta.logprobs)
                if delta.text or delta.finished or logprobs is not None:
                    choice = protocol.choice(index, delta.text, delta.finish_reason, logprobs)
                    yield event({**header, "choices": [choice]})
            if include_usage:
                outputs: list[RequestOutput] = [await h.wait() for h in handles]
                yield event({**header, "choices": [], "usage": protocol.usage(outputs)})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancels this generator) or the stream ended
            for handle in handles:
                handle.cancel()


def _cancel_handles(made: asyncio.Future) -> None:
    if not made.cancelled() and made.exception() is None:
        for handle in made.result():
            handle.cancel()
