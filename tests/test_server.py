"""The OpenAI-compatible server, started for real on a free 127.0.0.1 port and called with the official
`openai` client and raw httpx: outputs equal `LLM.generate` for the same request (fp32), errors have
OpenAI's shape and name the field, clients that go away free their KV blocks, and nothing a client
sends brings the server down. Tests that need the engine mid-step hold it there, never sleep."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from minigpt import LLM, AsyncLLM, SamplingParams
from minigpt.engine.config import EngineConfig
from minigpt.server.app import build_app

MODEL = "tiny-gpt2"
N_POSITIONS = 1024  # room for long generations: a client that disconnects is always mid-request
PROMPTS = ["Hello, my name is", "日本語のテキスト 🎉", "The quick brown fox", "x"]
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Served:
    url: str
    llm: AsyncLLM

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@contextmanager
def run_server(app, config: uvicorn.Config | None = None) -> Iterator[str]:
    """uvicorn on a background thread (`config`, else a plain one), port chosen by the OS; yields the base URL."""
    config = config or uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                      timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(2000):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory(n_positions=N_POSITIONS)


@pytest.fixture(scope="module")
def reference(checkpoint) -> Iterator[LLM]:
    with LLM(str(checkpoint)) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(checkpoint) -> Iterator[Served]:
    with AsyncLLM(str(checkpoint), kv_cache_tokens=32768) as llm, run_server(build_app(llm, MODEL)) as url:
        yield Served(url, llm)


@pytest.fixture(scope="module")
def guarded(served) -> Iterator[Served]:
    """The same engine behind an API key and a 4 KiB body limit."""
    with run_server(build_app(served.llm, MODEL, api_key="sesame", max_body_bytes=4096)) as url:
        yield Served(url, served.llm)


@pytest.fixture(scope="module")
def tight(checkpoint) -> Iterator[Served]:
    """An engine of its own that lets one request wait, for overload and fault tests."""
    with AsyncLLM(str(checkpoint), max_waiting=1, kv_cache_tokens=4096) as llm:
        with run_server(build_app(llm, MODEL)) as url:
            yield Served(url, llm)


class Gate:
    """Holds the engine thread inside its next model call until released (or makes that call raise)."""

    def __init__(self, llm: AsyncLLM, monkeypatch, fail: bool = False) -> None:
        self.entered, self._open = threading.Event(), threading.Event()
        forward, armed = llm.engine.runner.run, [True]

        def gated(*args, **kwargs):
            if armed[0]:
                armed[0] = False
                self.entered.set()
                self._open.wait()
                if fail:
                    raise RuntimeError("injected fault")
            return forward(*args, **kwargs)

        monkeypatch.setattr(llm.engine.runner, "run", gated)

    def release(self) -> None:
        self._open.set()


def wait_idle(llm: AsyncLLM):
    """The engine's metrics once nothing runs, waits or holds a KV block (bounded poll)."""
    for _ in range(2000):
        m = llm.metrics()
        if m.requests_running == m.requests_waiting == m.kv_blocks_used == 0 == m.requests_total - m.requests_finished:
            return m
        time.sleep(0.01)
    raise AssertionError(f"the engine is still busy: {m}")


def generate(reference: LLM, prompt, **params):
    return reference.generate([prompt], SamplingParams(**params))[0]


# -- completions, equal to LLM.generate -------------------------------------------------------------


def test_models_health_and_metrics(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client().models.retrieve(MODEL) == models.data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        served.client().models.retrieve("org/other-model")
    assert missing.value.code == "model_not_found" and "'org/other-model' does not exist" in missing.value.message
    card = httpx.get(f"{served.url}/v1/models/").json()["data"][0]
    assert card["id"] == MODEL and card["batch_invariant"] is False
    assert card["cpu_class"].startswith(torch.backends.cpu.get_cpu_capability())
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    response = httpx.get(f"{served.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for name in ("requests_total", "kv_blocks_used", "requests_running", "requests_waiting", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket"):
        assert f"minigpt_{name}" in text


def test_greedy_completions_equal_generate(served, reference):
    token_prompt = reference.tokenizer.encode("Token ids work too")
    for prompt in (PROMPTS, token_prompt, [token_prompt, token_prompt[:2]]):
        response = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        prompts = prompt if isinstance(prompt[0], (str, list)) else [prompt]
        wants = reference.generate(prompts, SamplingParams(max_tokens=24))
        assert response.object == "text_completion" and response.id.startswith("cmpl-") and response.model == MODEL
        assert [c.index for c in response.choices] == list(range(len(prompts)))
        assert [(c.text, c.finish_reason) for c in response.choices] == [(w.text, w.finish_reason) for w in wants]
        prompt_tokens = sum(len(w.prompt_token_ids) for w in wants)
        completion_tokens = sum(len(w.token_ids) for w in wants)
        assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
            prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def test_stream_joins_to_generate_output(served, reference):
    stream = served.client().completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=30, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in stream:
        assert chunk.object == "text_completion" and chunk.model == MODEL
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            assert reasons[c.index] is None, "no chunk after a choice's finish_reason"
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason
    wants = reference.generate(PROMPTS[:2], SamplingParams(max_tokens=30))
    assert list(zip(texts, reasons, strict=True)) == [(w.text, w.finish_reason) for w in wants]
    assert usage.completion_tokens == sum(len(w.token_ids) for w in wants)


def streamed_chunks(url: str, body: dict) -> list[dict]:
    """The JSON chunks of a raw streaming response (not [DONE])."""
    with httpx.stream("POST", url, json=body) as response:
        return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: {")]


def test_with_include_usage_every_chunk_carries_usage_null_until_the_last(served):
    body = {"prompt": ["Hi", "Ho"], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    chunks = streamed_chunks(f"{served.url}/v1/completions", body)
    assert [chunk["usage"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["choices"] == []
    assert all("usage" not in chunk for chunk in streamed_chunks(f"{served.url}/v1/completions",
                                                                 {**body, "stream_options": None}))


def test_raw_stream_ends_with_done(served):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True, "echo": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: "):])
    assert first["choices"][0]["text"] == "Hi"  # echo: the prompt comes first


@pytest.mark.parametrize("fields", [
    dict(temperature=0.8, seed=7, n=2),
    dict(temperature=1.0, seed=3, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=0.7, seed=5, extra_body=dict(top_k=20, min_p=0.05, repetition_penalty=1.2, min_tokens=4)),
    dict(temperature=0, extra_body=dict(ignore_eos=True, stop_token_ids=[0, 1, 2])),
])
def test_sampling_fields_reach_the_engine(served, reference, fields):
    extra = fields.pop("extra_body", {})
    response = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, extra_body=extra,
                                                  **fields)
    want = generate(reference, PROMPTS[0], max_tokens=20, **fields, **extra)
    assert [(c.index, c.text, c.finish_reason) for c in response.choices] == [
        (o.index, o.text, o.finish_reason) for o in want.outputs]


def test_logit_bias_and_allowed_ids_reach_the_engine(served, reference):
    """OpenAI's logit_bias (ids as strings, -100 bans a token) and vLLM's allowed_token_ids."""
    first = generate(reference, PROMPTS[0], max_tokens=1).token_ids[0]
    bias = {first: -100.0, 13: 5.0, 198: 2.5}
    response = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                  logit_bias={str(t): b for t, b in bias.items()})
    want = generate(reference, PROMPTS[0], max_tokens=12, logit_bias=bias)
    assert response.choices[0].text == want.text and want.token_ids[0] != first
    allowed = [11, 13, 198, 262]
    response = served.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0,
                                                  seed=4, logit_bias={"11": 1}, logprobs=0,
                                                  extra_body={"allowed_token_ids": allowed})
    want = generate(reference, PROMPTS[2], max_tokens=12, temperature=1.0, seed=4, logit_bias={11: 1.0},
                    allowed_token_ids=allowed)
    assert response.choices[0].text == want.text
    assert set(want.token_ids) <= set(allowed)


def test_openapi_schema_describes_the_request_fields(served):
    schema = httpx.get(f"{served.url}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    fields = schema["properties"]
    bias = fields["logit_bias"]["anyOf"][0]
    assert bias["patternProperties"] == {"^[0-9]+$": {"type": "number", "minimum": -100, "maximum": 100}}
    assert fields["allowed_token_ids"]["anyOf"][0] == {"type": "array", "items": {"type": "integer"}}
    assert {"top_k", "min_p", "stop_token_ids", "min_tokens"} <= set(fields)


def test_stop_string_ends_the_text_before_it(served, reference):
    full = generate(reference, PROMPTS[2], max_tokens=40).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    response = served.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                                  stop=[stop])
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == full[: full.index(stop)]


def test_logprobs_with_echo(served, reference):
    response = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                  logprobs=3, echo=True)
    want = generate(reference, PROMPTS[0], max_tokens=6, logprobs=3, prompt_logprobs=3)
    choice, lp = response.choices[0], response.choices[0].logprobs
    assert choice.text == PROMPTS[0] + want.text
    ids = want.prompt_token_ids + want.token_ids
    assert lp.tokens == [reference.tokenizer.decode([i]) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [t.logprob for t in want.prompt_logprobs[1:] + want.outputs[0].logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert 3 <= len(top) <= 4 and top[token] == value  # the chosen token is always listed
    assert all(choice.text[offset:].startswith(token) for offset, token in zip(lp.text_offset, lp.tokens, strict=True))


def test_streamed_logprobs_join_to_the_unstreamed_ones(served):
    """Greedy, so both requests make the same tokens: the chunks' logprobs, offsets running on across
    them, join to the logprobs of the whole response, choice by choice (a stop string cuts one short).
    Values within 1e-4: the two requests' prompts may be batched differently, which rounds differently."""
    kwargs = dict(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0, logprobs=2)
    free = served.client().completions.create(**kwargs).choices[0].text
    kwargs["stop"] = [free[len(free) // 2 :][:3]]
    whole = served.client().completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop"
    joined = {c.index: {"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
              for c in whole.choices}
    for chunk in served.client().completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            joined[c.index]["text"] += c.text
            for key, values in (c.logprobs.model_dump() if c.logprobs else {}).items():
                joined[c.index][key] += values
    for c in whole.choices:
        got, want = joined[c.index], c.logprobs
        assert (got["text"], got["tokens"], got["text_offset"]) == (c.text, want.tokens, want.text_offset)
        assert got["token_logprobs"] == pytest.approx(want.token_logprobs, abs=1e-4)
        for top, expected in zip(got["top_logprobs"], want.top_logprobs, strict=True):
            assert top == pytest.approx(expected, abs=1e-4)
    assert len(whole.choices[0].logprobs.tokens) > 1


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "status", "param", "says"), [
    ('{"prompt": "hi",', 400, None, "not valid JSON"),
    ("[1, 2]", 400, None, "JSON object"),
    ({}, 400, "prompt", "required"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    ({"prompt": "hi", "max_token": 5}, 400, "max_token", "unknown field"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "every": 1}}, 400, "stream_options",
     "unknown field 'stream_options.every'"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400,
     "response_format", "response_format.json_schema.name is required"),
    ({"prompt": "hi", "stop": 5}, 400, "stop", "stop: Input should be a valid string or a valid list"),
    ({"prompt": "hi", "temperature": "hot", "top_p": "x"}, 400, "temperature", "temperature: Input should be a valid"),
    ({"prompt": "hi", "max-tokens": 5, "top-p": 0.9}, 400, "max-tokens", "unknown field 'max-tokens'"),
    ({"prompt": "hi", "stream": True, "stream_options": {"Include-Usage": True}}, 400, "stream_options",
     "unknown field 'stream_options.Include-Usage'"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n", "n must be"),
    ({"prompt": "hi", "n": 129}, 400, "n", "n must be at most 128"),
    ({"prompt": ["hi"] * 17, "n": 128}, 400, "n", "at most 2048 completions (prompts x n), got 2176"),
    ({"prompt": [[1]] * 2049}, 400, "prompt", "at most 2048 completions"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens=0 scores a prompt only with echo=true"),
    ({"prompt": "hi", "max_tokens": 0, "logprobs": 1}, 400, "max_tokens", "only with echo=true"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ({"prompt": "hi", "logprobs": 21, "echo": True}, 400, "logprobs", "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", "stop"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(60000)]}, 400, "stop", "at most 256 (max_stop_strings)"),
    ({"prompt": "hi", "stop": ["x" * 9000] * 2}, 400, "stop", "at most 16384 in all (max_stop_chars)"),
    ({"prompt": [True]}, 400, "prompt", "token ids"),
    ({"prompt": []}, 400, "prompt", "empty"),
    ({"prompt": [50257]}, 400, "prompt", "vocabulary"),
    ({"prompt": ["ok", [1, 2]]}, 400, "prompt", "token ids"),
    ({"prompt": [1] * 1000, "max_tokens": 100}, 400, "prompt", "context"),
    ({"prompt": ["ok", " hello" * 1100], "max_tokens": 16}, 400, "prompt", "prompt 1"),
    ({"prompt": "hi", "stream": True, "logprobs": 1, "echo": True}, 400, "logprobs", "stream"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of", "best_of"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix", "suffix"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", "pattern"),
    ({"prompt": "hi", "logit_bias": {"-1": 1}}, 400, "logit_bias", "pattern"),
    ({"prompt": "hi", "logit_bias": {"5": 100.5}}, 400, "logit_bias", "less than or equal to 100"),
    ({"prompt": "hi", "logit_bias": {"5": -101}}, 400, "logit_bias", "greater than or equal to -100"),
    ({"prompt": "hi", "logit_bias": {"5": "1"}}, 400, "logit_bias", "number"),
    ({"prompt": "hi", "logit_bias": {"50257": 1}}, 400, "logit_bias", "logit_bias has token id 50257, outside"),
    ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids", "non-empty"),
    ({"prompt": "hi", "allowed_token_ids": [-3]}, 400, "allowed_token_ids", "allowed_token_ids must be"),
    ({"prompt": ["a", "b"], "allowed_token_ids": [50257]}, 400, "allowed_token_ids",
     "prompt 0: allowed_token_ids has token id 50257"),
])
def test_invalid_requests_get_openai_errors(served, body, status, param, says):
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    response = httpx.post(f"{served.url}/v1/completions", content=content,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and says in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_not_sent_as_json_is_told_so(served, content_type):
    """curl -d sends form encoding unless told otherwise: the error names the Content-Type to use."""
    response = httpx.post(f"{served.url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}',
                          headers={"Content-Type": content_type})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "Content-Type: application/json" in message and content_type in message


def test_a_json_body_sent_without_content_type_is_told_to_name_it(served):
    response = httpx.post(f"{served.url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 2}')
    assert response.status_code == 400
    assert "Content-Type: application/json (the request had none)" in response.json()["error"]["message"]


def test_openai_client_sees_errors(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="davinci", prompt="hi")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as no_route:
        client.get("/nothing-here", cast_to=object)
    assert "/v1/nothing-here" in no_route.value.message
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_api_key(guarded):
    url = f"{guarded.url}/v1/completions"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        response = httpx.post(url, json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url, content=b"{", headers={"Content-Type": "application/json"}).status_code == 401  # key first
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    assert guarded.client("sesame").completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_body_size_limit(guarded):
    url, auth = f"{guarded.url}/v1/completions", {"Authorization": "Bearer sesame"}
    big = {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 2}
    response = httpx.post(url, json=big, headers=auth)
    assert response.status_code == 413 and "4096 bytes" in response.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit counts what arrives
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"word " * 20
        yield b'"}'

    response = httpx.post(url, content=chunked(), headers={**auth, "Content-Type": "application/json"})
    assert response.status_code == 413
    assert httpx.post(url, json={"model": MODEL, "prompt": "word " * 100, "max_tokens": 2},
                      headers=auth).status_code == 200


# -- load and faults --------------------------------------------------------------------------------


def test_full_queue_answers_503_at_once(tight, monkeypatch):
    gate = Gate(tight.llm, monkeypatch)
    first: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "first", "max_tokens": 4, "temperature": 0}
    sender = threading.Thread(target=lambda: first.append(httpx.post(f"{tight.url}/v1/completions", json=body)))
    sender.start()
    try:
        assert gate.entered.wait(60), "the first request never reached the engine"
        with pytest.raises(openai.InternalServerError) as refused:  # the first one waits: the queue is full
            tight.client().completions.create(model=MODEL, prompt="second", max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "queue_full"
        assert refused.value.response.headers["retry-after"] == "1"
    finally:
        gate.release()
        sender.join()
    assert first[0].status_code == 200
    wait_idle(tight.llm)


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_retry(tight):
    """max_waiting=1: two prompts can never wait together, so a 503 (retry later) would loop forever."""
    response = httpx.post(f"{tight.url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt" and "max_waiting" in response.json()["error"]["message"]
    assert httpx.post(f"{tight.url}/v1/completions", json={"prompt": ["a"], "max_tokens": 2}).status_code == 200
    wait_idle(tight.llm)


def test_failing_step_fails_only_its_request(tight, reference, monkeypatch):
    gate = Gate(tight.llm, monkeypatch, fail=True)
    gate.release()
    with pytest.raises(openai.InternalServerError) as failed:
        tight.client().completions.create(model=MODEL, prompt="doomed", max_tokens=4)
    assert failed.value.status_code == 500 and "injected fault" in failed.value.message
    response = tight.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert response.choices[0].text == generate(reference, PROMPTS[0], max_tokens=8).text
    assert httpx.get(f"{tight.url}/health").status_code == 200
    wait_idle(tight.llm)


def test_concurrent_streams_with_disconnects(served, reference):
    """16 streaming clients at once; every 4th leaves after two chunks of a 1000-token request."""
    quitters = set(range(0, 16, 4))
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]
    lengths = [1000 if i in quitters else 10 + 3 * i for i in range(16)]
    before = served.llm.metrics()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i],
                                                 temperature=0, stream=True, extra_body={"ignore_eos": i in quitters})
        text, reason, chunks = "", None, 0
        async with stream:
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason
                chunks += 1
                if i in quitters and chunks == 2:
                    break  # leaving the block closes the connection mid-stream
        return text, reason

    async def everyone() -> list[tuple[str, str | None]]:
        async with served.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(everyone())
    finished = [i for i in range(16) if i not in quitters]
    params = [SamplingParams(max_tokens=lengths[i]) for i in finished]
    wants = reference.generate([prompts[i] for i in finished], params)
    assert [results[i] for i in finished] == [(w.text, w.finish_reason) for w in wants]
    after = wait_idle(served.llm)
    assert after.finish_reasons.get("abort", 0) - before.finish_reasons.get("abort", 0) == len(quitters)
    assert after.generation_tokens_total - before.generation_tokens_total < sum(lengths)  # the quitters stopped
    assert max(after.batch_size_histogram) > 1  # requests shared steps
    assert "minigpt_kv_blocks_used 0" in httpx.get(f"{served.url}/metrics").text
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_client_leaving_a_plain_request_cancels_it(served):
    before = served.llm.metrics()

    async def leave() -> None:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 1000, "ignore_eos": True}
        async with httpx.AsyncClient() as client:
            request = asyncio.create_task(client.post(f"{served.url}/v1/completions", json=body))
            for _ in range(2000):
                if served.llm.metrics().requests_total > before.requests_total:
                    break
                await asyncio.sleep(0.01)
            request.cancel()  # drops the connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave())
    after = wait_idle(served.llm)
    assert after.finish_reasons.get("abort", 0) == before.finish_reasons.get("abort", 0) + 1


# -- the command line and the load generator ---------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serves_with_an_api_key(checkpoint):
    """The key from $MINIGPT_API_KEY; the model served by its folder's name, never its path."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minigpt.serve", "--model", str(checkpoint), "--port", str(port),
         "--threads", "1", "--max-waiting", "8", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "MINIGPT_API_KEY": "k"})
    try:
        for _ in range(6000):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.02)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == [checkpoint.name]
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        assert str(checkpoint.parent) not in missing.value.message
        assert client.completions.create(model=checkpoint.name, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait()


def test_cli_without_the_server_extra(monkeypatch, capsys):
    from minigpt import serve

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert serve.main(["--model", "unused"]) == 2
    assert 'pip install "minigpt[server]"' in capsys.readouterr().err


def test_cli_flags_cover_the_engine():
    from minigpt import serve
    from minigpt.cli import engine_args_from

    args = serve.build_parser().parse_args(
        ["--model", "m", "--max-waiting", "3", "--kv-cache-tokens", "256", "--kv-cache-dtype", "bfloat16"]
    )
    assert args.host == "127.0.0.1"
    config = EngineConfig(**engine_args_from(args))
    assert (config.max_waiting, config.kv_cache_tokens, config.kv_cache_dtype) == (3, 256, "bfloat16")


def test_load_test_script(served):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "load_test.py"), "--url", f"{served.url}/v1/completions",
         "--rate", "50", "--num-requests", "8", "--output-tokens", "4:12", "--long-prompt-words", "50:60", "--json"],
        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["requests_ok"] == 8 and summary["errors"] == {}
    assert summary["completion_tokens"] > 0 and summary["ttft_p50_ms"] > 0
    wait_idle(served.llm)


def test_echo_with_max_tokens_zero_scores_the_prompt(served, reference):
    """OpenAI's legacy scoring call: the prompt echoed with its log-probabilities, nothing generated."""
    client = served.client()
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
    want = generate(reference, PROMPTS[0], max_tokens=0, prompt_logprobs=1)
    choice = response.choices[0]
    assert choice.text == PROMPTS[0] and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [reference.tokenizer.decode([i]) for i in want.prompt_token_ids]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([t.logprob for t in want.prompt_logprobs[1:]], abs=1e-4)
    assert response.usage.completion_tokens == 0
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPTS[1] and plain.choices[0].logprobs is None


def test_cli_refuses_a_port_it_cannot_listen_on_before_loading(capsys):
    """A port out of range, or one already taken, is one line and exit 2, before the model loads (here no
    model could: the path does not exist, and its error never shows)."""
    from minigpt import serve

    with pytest.raises(SystemExit) as exited:
        serve.main(["--model", "/no/such/dir", "--port", "99999"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a port is a number in [0, 65535], got '99999'" in err[0], err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve.main(["--model", "/no/such/dir", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"minigpt.serve: error: cannot listen on 127.0.0.1:{port}"), err


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_is_not_unicode_is_a_400_before_anything_runs(served, stream):
    """JSON's escape of a lone surrogate decodes to no text: refused at once, where echoing it would fail to
    encode the answer (a 500, or a stream cut before its first event)."""
    body = b'{"model": "%s", "prompt": "hi \\ud800", "max_tokens": 3, "echo": true, "stream": %s}' % (
        MODEL.encode(), b"true" if stream else b"false")
    response = httpx.post(f"{served.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "prompt is not valid Unicode: U+D800 at character 3" in error["message"]
    wait_idle(served.llm)
