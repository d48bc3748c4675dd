"""One OpenAI Batch input line answered by the server's own builders; its ids derive from the custom_id (else
the line number), so a resumed job writes what an uninterrupted one writes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi.exceptions import RequestValidationError

from minigpt.async_llm.async_engine import AsyncLLM
from minigpt.batch_jobs.window import Window
from minigpt.server import protocol, responses
from minigpt.server.chat import ChatCompletionRequest, chat_body, chat_plan
from minigpt.server.chat_template import ChatTemplate
from minigpt.server.errors import APIError, check_model, invalid, validation_error
from minigpt.server.protocol import CompletionRequest, EnginePlan
from minigpt.server.submit import failure, submit_plan

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)
LINE_FIELDS = ("custom_id", "method", "url", "body")

logger = logging.getLogger("minigpt.batch")


def line_key(custom_id: object, number: int) -> int:
    key = f"custom_id:{custom_id}" if isinstance(custom_id, str) else f"line:{number}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "big")


def output_id(key: int) -> str:
    return f"batch_req_{key:032x}"


def key_of_output_id(text: object) -> int | None:
    if not isinstance(text, str) or not text.startswith("batch_req_"):
        return None
    try:
        return int(text.removeprefix("batch_req_"), 16)
    except ValueError:
        return None


def custom_id_of(text: str | UnicodeDecodeError) -> object:
    if isinstance(text, UnicodeDecodeError):
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return None
    return record.get("custom_id") if isinstance(record, dict) else None


@dataclass
class Answer:

    record: dict
    failed: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Answerer:
    """`template` None: chat is a 400."""

    def __init__(self, llm: AsyncLLM, model_name: str, template: ChatTemplate | None, window: Window) -> None:
        self.llm = llm
        self.model_name = model_name
        self.template = template
        self.window = window

    async def answer(self, number: int, text: str | UnicodeDecodeError) -> Answer:
        try:
            record = _request_line(number, text)
        except APIError as err:
            custom_id = custom_id_of(text)
            return _answer(line_key(custom_id, number), custom_id, err.status, err.body())
        custom_id = record["custom_id"]
        key = line_key(custom_id, number)
        try:
            body = await self._body(record["url"], record["body"], key)
        except APIError as err:
            return _answer(key, custom_id, err.status, err.body())
        except Exception as err:  # as the server answers a crash: this line fails, the job goes on
            logger.exception("line %d failed", number)
            error = APIError(500, f"internal error: {type(err).__name__}: {err}", "server_error")
            return _answer(key, custom_id, error.status, error.body())
        usage = body["usage"]
        return _answer(key, custom_id, 200, body, usage["prompt_tokens"], usage["completion_tokens"])

    async def _body(self, url: str, sent: Any, key: int) -> dict:
        model = CompletionRequest if url == COMPLETIONS else ChatCompletionRequest
        try:
            body = model.model_validate(sent)
        except pydantic.ValidationError as err:  # as FastAPI reports a body it refuses
            errors = [{**error, "loc": ("body", *error["loc"])} for error in err.errors()]
            raise validation_error(RequestValidationError(errors, body=sent), "application/json") from None
        check_model(body.model, self.model_name)
        if body.stream:
            raise invalid("stream is not supported in a batch job: its answer is one line", "stream")
        tokenizer = self.llm.tokenizer
        if isinstance(body, CompletionRequest):
            plan = protocol.completion_plan(body)
            outputs = await self._run(plan)
            return responses.completion_body(body, plan, outputs, tokenizer, self.model_name, f"cmpl-{key:032x}")
        plan = chat_plan(body, self.template, tokenizer, self.llm.engine.model_config.n_positions)
        outputs = await self._run(plan)
        return chat_body(body, outputs[0], tokenizer, self.model_name, f"chatcmpl-{key:032x}")

    async def _run(self, plan: EnginePlan) -> list:
        units = await self.window.acquire(len(plan.prompts))
        try:
            handles = submit_plan(self.llm, plan)
            try:
                outputs = await asyncio.gather(*(h.wait() for h in handles))
            finally:
                for handle in handles:
                    handle.cancel()  # a no-op for finished requests
        finally:
            self.window.release(units)
        error = failure(handles)
        if error is not None:
            raise error
        if any(c.finish_reason == "abort" for out in outputs for c in out.outputs):  # only the engine aborts here
            raise APIError(503, f"the engine stopped: {self.llm.problem() or 'closed'}", "server_error")
        return outputs


def _request_line(number: int, text: str | UnicodeDecodeError) -> dict:
    """The fields of an input line; a 400 naming what is wrong with a line that is no request."""
    if isinstance(text, UnicodeDecodeError):
        raise invalid(f"line {number} is not UTF-8 text (byte {text.start}: {text.reason})")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise invalid(f"line {number} is not valid JSON: {err}") from None
    if not isinstance(record, dict):
        raise invalid(f"line {number} must be a JSON object with {', '.join(LINE_FIELDS)}")
    unknown = [name for name in record if name not in LINE_FIELDS]
    if unknown:
        raise invalid(f"line {number}: unknown field {unknown[0]!r} (a line has {', '.join(LINE_FIELDS)})",
                      unknown[0])
    if not isinstance(record.get("custom_id"), str):
        raise invalid(f"line {number}: custom_id must be a string", "custom_id")
    if record.get("method") != "POST":
        raise invalid(f"line {number}: method must be \"POST\", got {record.get('method')!r}", "method")
    if record.get("url") not in URLS:
        raise invalid(f"line {number}: url must be {' or '.join(URLS)}, got {record.get('url')!r}", "url")
    if "body" not in record:
        raise invalid(f"line {number}: body is required", "body")
    return record


def _answer(key: int, custom_id: object, status: int, body: dict, prompt_tokens: int = 0,
            completion_tokens: int = 0) -> Answer:
    error = None
    if status != 200:
        error = {"code": body["error"]["code"] or body["error"]["type"], "message": body["error"]["message"]}
    record = {"id": output_id(key), "custom_id": custom_id if isinstance(custom_id, str) else None,
              "response": {"status_code": status, "request_id": f"req_{key:032x}", "body": body}, "error": error}
    return Answer(record, status != 200, prompt_tokens, completion_tokens)
