"""OpenAI-style errors: every failure answers {"error": {"message", "type", "param", "code"}}.

Clients (the official `openai` package among them) read `message` and `param` from this body, so
every path that can reject a request (validation, auth, limits, unknown routes, crashes) uses it.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("minigpt.server")


class APIError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def check_model(model: str | None, served: str) -> None:
    """A request may name the served model or none; any other name is OpenAI's 404 model_not_found."""
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def validation_error(err: RequestValidationError, content_type: str | None = None) -> APIError:
    """The first pydantic error as a 400 naming the field: malformed JSON, wrong types, unknown fields.
    `content_type`: the request's; a body sent as something else (curl -d's form encoding) is not read as JSON."""
    first = err.errors()[0]
    kind, loc = first["type"], [str(part) for part in first["loc"][1:]]  # loc[0] is "body"
    if kind == "json_invalid":
        return invalid(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc and content_type is not None and "json" not in content_type.lower():
        return invalid(f"the request body must be JSON, sent with Content-Type: application/json (not {content_type})")
    if not loc:
        return invalid("the request body must be a JSON object")
    param = loc[0]
    if kind == "extra_forbidden":
        return invalid(f"unknown field {param!r}", param)
    if kind == "missing":
        return invalid(f"{param} is required", param)
    if param == "prompt" and len(loc) > 1:  # one of the completions prompt's forms (/tokenize takes text)
        return invalid("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
                       param)
    where = ".".join(loc)
    return invalid(f"{where}: {first['msg']}", param)


def install_handlers(app: FastAPI) -> None:
    """Route every error the app can raise to an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return validation_error(err, request.headers.get("content-type")).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        message = f"{err.detail}: {request.method} {request.url.path}"
        return APIError(err.status_code, message, kind, headers=err.headers).response()

    @app.exception_handler(Exception)
    async def crash(_: Request, err: Exception) -> JSONResponse:
        logger.exception("request failed")
        return APIError(500, f"internal error: {type(err).__name__}: {err}", "server_error").response()
