"""OpenAI-style errors: every failure answers {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger("minigpt.server")


class APIError(Exception):
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
    """A pydantic error as a 400 naming the field by its whole path (`param`: the top-level field); a body sent
    with another `content_type` (curl -d's form encoding) or none is not read as JSON."""
    errors = err.errors()
    locs = [error["loc"][1:] for error in errors]  # loc[0] is "body"
    deepest = max(errors, key=lambda error: len(error["loc"]))  # the union member the value came closest to
    kind, loc = deepest["type"], _field_path(deepest["loc"][1:], locs, err.body)
    if kind == "json_invalid":
        return invalid(f"the request body is not valid JSON: {deepest.get('ctx', {}).get('error', deepest['msg'])}")
    if not loc and (content_type is None or "json" not in content_type.lower()):
        sent = f"not {content_type}" if content_type is not None else "the request had none"
        return invalid(f"the request body must be JSON, sent with Content-Type: application/json ({sent})")
    if not loc:
        return invalid("the request body must be a JSON object")
    param, where = str(loc[0]), "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)[1:]
    if kind == "extra_forbidden":
        return invalid(f"unknown field {where!r}", param)
    if kind == "missing":
        return invalid(f"{where} is required", param)
    if param == "prompt" and len(loc) > 1:  # one of the completions prompt's forms (/tokenize takes text)
        return invalid("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
                       param)
    # a value no member of a union takes: what each member wanted ("a valid string or a valid list")
    wanted = [error["msg"] for error in errors
              if len(error["loc"]) == len(deepest["loc"]) and _field_path(error["loc"][1:], locs, err.body) == loc]
    return invalid(f"{where}: " + " or ".join(dict.fromkeys(
        [wanted[0], *(message.removeprefix("Input should be ") for message in wanted[1:])])), param)


# How pydantic names a union's members in an error's location: "str", "list[TextPart]", "TextPart",
# "literal['never']", "function-after[...]"
_MEMBER = re.compile(r"^(str|int|float|bool|bytes|dict|list|none)$|[\[\-]|^[A-Z]")


def _field_path(loc: tuple, others: list[tuple], body: object) -> list:
    """`loc` without pydantic's names of union members (where `loc` and another error part ways, and no key of
    what was sent there) and of a dict's keys ("[key]")."""
    path, sent = [], body
    for index, part in enumerate(loc):
        if isinstance(sent, dict) and part in sent or isinstance(sent, list) and isinstance(part, int):
            sent = sent[part] if isinstance(sent, dict) or part < len(sent) else None
            path.append(part)
            continue
        member = isinstance(part, str) and _MEMBER.search(part) is not None and any(
            other[:index] == loc[:index] and len(other) > index and other[index] != part for other in others)
        if not member:  # a member names no level of the body: what follows indexes the same value
            sent = None
            if part != "[key]":
                path.append(part)
    return path


def install_handlers(app: FastAPI) -> None:
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
