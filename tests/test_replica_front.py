"""The Ray Serve front without a cluster: a replica that dies before its answer's first body leaves the request to
another replica, a whole answer is relayed whole, a stream chunk by chunk. Skipped without the ray extra."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")
from ray.exceptions import RayActorError  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402

from minigpt.replicas.serving import START_TRIES, Front  # noqa: E402

ANSWER = json.dumps({"choices": [{"text": " world", "finish_reason": "length"}]}).encode()
START = {"type": "http.response.start", "status": 200,
         "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]}


class Replicas:
    """A deployment handle's stand-in: call i streams `answers[i]`'s messages, raising any exception among them."""

    def __init__(self, *answers: list) -> None:
        self.answers = list(answers)
        self.calls = 0

    def options(self, stream: bool) -> Replicas:
        assert stream
        return self

    @property
    def http(self) -> Replicas:
        return self

    def remote(self, forwarded) -> object:
        messages = self.answers[self.calls]
        self.calls += 1

        async def stream():
            for message in messages:
                if isinstance(message, Exception):
                    raise message
                yield message

        return stream()


def request() -> Request:
    body = json.dumps({"model": "m", "prompt": "Hello"}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 5000)}

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


async def answered(replicas: Replicas) -> tuple[int, dict, bytes, bool]:
    response = await Front(replicas)(request())
    if isinstance(response, StreamingResponse):
        body = b"".join([chunk async for chunk in response.body_iterator])
    else:
        body = response.body
    return response.status_code, dict(response.raw_headers), body, isinstance(response, StreamingResponse)


def body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_a_replica_dying_between_the_start_and_the_body_leaves_the_request_to_another():
    replicas = Replicas([START, RayActorError()], [START, body(ANSWER)])
    status, headers, got, streamed = asyncio.run(answered(replicas))
    assert (status, got, streamed, replicas.calls) == (200, ANSWER, False, 2)
    assert headers[b"content-length"] == str(len(ANSWER)).encode()


def test_every_replica_dying_before_the_body_is_a_503():
    replicas = Replicas(*[[START, RayActorError()]] * START_TRIES)
    status, _, got, _ = asyncio.run(answered(replicas))
    assert status == 503 and replicas.calls == START_TRIES
    assert b"no engine replica could answer" in got


def test_a_stream_is_relayed_chunk_by_chunk_and_its_cut_is_not_retried():
    chunks = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    sse = {**START, "headers": [(b"content-type", b"text/event-stream")]}
    whole = Replicas([sse, body(chunks[0], True), body(chunks[1], True), body(chunks[2])])
    assert asyncio.run(answered(whole)) == (200, {b"content-type": b"text/event-stream"}, b"".join(chunks), True)
    cut = Replicas([sse, body(chunks[0], True), RayActorError()], [sse, body(b"".join(chunks))])
    with pytest.raises(RayActorError):
        asyncio.run(answered(cut))
    assert cut.calls == 1
