"""The FastAPI app: its routes, middleware and error handlers."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from minigpt.async_llm.async_engine import AsyncLLM
from minigpt.common.version import __version__
from minigpt.server.chat import ChatServer
from minigpt.server.chat_template import ChatTemplate
from minigpt.server.completions import CompletionServer
from minigpt.server.errors import install_handlers
from minigpt.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT
from minigpt.server.middleware import BearerAuth, BodyLimits, check_api_key
from minigpt.server.tokenization import Tokenization

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
