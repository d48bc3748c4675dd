"""Structured outputs through the server: vLLM's `structured_outputs` and OpenAI's `response_format` on
/v1/completions give outputs that obey them; a bad constraint is an OpenAI-shaped 400 naming the field
it came from, never a 500; the OpenAPI schema describes both fields."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from test_server import MODEL, N_POSITIONS, Served, run_server, wait_idle

from minigpt import AsyncLLM
from minigpt.server.app import build_app
from minigpt.structured.grammar import compiler_for

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(checkpoint_factory) -> Iterator[Served]:
    checkpoint = checkpoint_factory(n_positions=N_POSITIONS)
    with AsyncLLM(str(checkpoint), kv_cache_tokens=4096) as llm, run_server(build_app(llm, MODEL)) as url:
        yield Served(url, llm)
        assert llm.engine.kv_cache_info()["blocks_in_use"] == 0


def complete(served: Served, **fields) -> httpx.Response:
    body = {"prompt": "Hello", "max_tokens": 60, "temperature": 1.0, "seed": 0, "n": 4, **fields}
    return httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)


def texts(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert all(c["finish_reason"] == "stop" for c in choices), choices
    return [c["text"] for c in choices]


def test_structured_outputs_json_validates(served):
    for text in texts(complete(served, structured_outputs={"json": SCHEMA})):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(("constraint", "check"), [
    ({"regex": r"[a-c]{2}-\d{2}"}, lambda t: re.fullmatch(r"[a-c]{2}-\d{2}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "x" /[0-9]/ "y"'}, lambda t: re.fullmatch(r"x[0-9]y", t)),
])
def test_structured_outputs_regex_choice_grammar(served, constraint, check):
    for text in texts(complete(served, structured_outputs=constraint)):
        assert check(text), text


def test_response_format_json_schema_validates(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    for text in texts(complete(served, response_format=fmt)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object_and_text(served):
    out = complete(served, response_format={"type": "json_object"}, max_tokens=5, n=1)
    assert out.status_code == 200 and out.json()["choices"][0]["text"].startswith("{")
    plain = complete(served, response_format={"type": "text"}, max_tokens=5, n=1, temperature=0)
    unconstrained = complete(served, max_tokens=5, n=1, temperature=0)
    assert plain.json()["choices"][0]["text"] == unconstrained.json()["choices"][0]["text"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
    ({"structured_outputs": {"nope": 1}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens"),
])
def test_bad_constraints_are_400_naming_the_field(served, fields, param):
    out = complete(served, **fields)
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "StructuredOutputsParams" not in error["message"]  # the class behind the field is not the client's


@pytest.mark.parametrize(("fields", "says"), [
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json is not valid"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format.json_schema.schema is not valid"),
])
def test_a_bad_schema_is_named_where_the_request_put_it(served, fields, says):
    assert says in complete(served, **fields).json()["error"]["message"]


def test_openapi_schema_describes_the_fields(served):
    schema = httpx.get(f"{served.url}/openapi.json").json()
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"structured_outputs", "response_format"} <= set(request)
    structured = schema["components"]["schemas"]["StructuredOutputs"]["properties"]
    assert set(structured) == {"json", "regex", "choice", "grammar", "json_object"}


def test_missing_extra_is_a_400_naming_the_install(served, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    compiler_for.cache_clear()
    try:
        out = complete(served, structured_outputs={"regex": "[ab]"}, n=1)
    finally:
        compiler_for.cache_clear()
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == "structured_outputs" and "pip install minigpt[structured]" in error["message"]


@pytest.mark.parametrize("constraint", [{"regex": "a{1000}{1000}"},
                                        {"choice": ["!", *(f"zoo {i}" for i in range(2500))]}])
def test_a_grammar_that_would_fail_at_generation_is_a_400(served, constraint):
    """llguidance validates these, then fails at the first token: refused at submission, without the ~1 KB
    of parser state its error carries."""
    out = complete(served, structured_outputs=constraint)
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == "structured_outputs" and "<state>" not in error["message"], error


def hold_grammar_compiles(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Grammar compiles wait for the second event once they have set the first."""
    from minigpt.structured.grammar import GrammarCompiler

    entered, release, compile = threading.Event(), threading.Event(), GrammarCompiler.compile

    def held(self, params):
        entered.set()
        release.wait()
        return compile(self, params)

    monkeypatch.setattr(GrammarCompiler, "compile", held)
    return entered, release


def test_grammars_compile_off_the_event_loop(served, monkeypatch):
    """While a grammar compiles (held here), the server answers /health and other requests."""
    entered, release = hold_grammar_compiles(monkeypatch)
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(complete(served, structured_outputs={"regex": "[ab]"})))
    sender.start()
    try:
        assert entered.wait(60), "the constrained request never reached the grammar compiler"
        assert httpx.get(f"{served.url}/health").status_code == 200
        assert complete(served, n=1, max_tokens=2).status_code == 200
    finally:
        release.set()
        sender.join()
    assert all(text in ("a", "b") for text in texts(answer[0]))


def test_a_client_gone_while_its_grammar_compiles_leaves_no_request_running(served, monkeypatch):
    entered, release = hold_grammar_compiles(monkeypatch)
    before = served.llm.metrics()

    async def leave() -> None:
        body = {"prompt": "Hello", "max_tokens": 500, "structured_outputs": {"regex": "[ab]{500}"}}
        async with httpx.AsyncClient() as client:
            request = asyncio.create_task(client.post(f"{served.url}/v1/completions", json=body))
            assert await asyncio.to_thread(entered.wait, 60), "the request never reached the grammar compiler"
            request.cancel()  # drops the connection while the request is being made
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave())
    release.set()
    for _ in range(2000):  # until the handler, which goes on after the client left, has made the request
        if served.llm.metrics().requests_total > before.requests_total:
            break
        time.sleep(0.01)
    after = wait_idle(served.llm)
    assert after.requests_total == before.requests_total + 1
    assert after.finish_reasons.get("abort", 0) == before.finish_reasons.get("abort", 0) + 1
