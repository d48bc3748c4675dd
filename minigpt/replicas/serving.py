"""`minigpt serve --replicas N` on Ray Serve: engine replicas, each the one-process server's app around an AsyncLLM,
behind a front that forwards each request to the replica the router picks and streams its answer back."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from minigpt.async_llm.async_engine import AsyncLLM
from minigpt.model.weights import resolve_checkpoint
from minigpt.replicas.cluster import ray_cluster
from minigpt.replicas.options import replica_resources
from minigpt.replicas.routing import PrefixAffinityRouter
from minigpt.server.app import build_app
from minigpt.server.chat_template import ChatTemplate
from minigpt.server.errors import APIError

APP, ENGINE = "minigpt", "minigpt-engine"
REPLICA_HEADER = b"x-minigpt-replica"
START_TRIES = 3  # a request whose replica dies before its answer's first body is sent again
LOST = (RayActorError, ActorUnavailableError)


@dataclass
class Forwarded:
    """An HTTP request as the front received it; `prompt` is what the router matches prefixes on."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    prompt: str

    def scope(self) -> dict:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "query_string": self.query,
                "root_path": "", "headers": self.headers, "client": self.client, "server": None}


def prompt_text(body: bytes) -> str:
    """A completion's prompt or a chat's messages as text ("" for a body with neither)."""
    try:
        sent = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ""
    if not isinstance(sent, dict):
        return ""
    prompt = sent.get("prompt", sent.get("messages", ""))
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], dict):
        prompt = prompt[0]  # the first of a batch of prompts
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


async def relay(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """The ASGI messages `app` sends answering a request of `scope` and `body`; closing the iterator cancels it."""
    sent: asyncio.Queue[dict] = asyncio.Queue()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client leaving reaches the app as a cancellation
        raise AssertionError("unreachable")

    task = asyncio.ensure_future(app(scope, receive, sent.put))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # the app's own error, else it ended without answering
                raise RuntimeError(f"{scope['path']}: the app ended without an answer")
            message = getter.result()
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
    finally:
        task.cancel()


class EngineReplica:
    """One replica: an engine and the one-process server's app around it."""

    def __init__(self, model: str, engine_args: dict, model_name: str, api_key: str | None, max_body_bytes: int,
                 chat_template: Path | None, read_timeout: float) -> None:
        template = ChatTemplate.for_checkpoint(resolve_checkpoint(model), chat_template)
        self.llm = AsyncLLM(model, **engine_args)
        self.app = build_app(self.llm, model_name, api_key, max_body_bytes, template, read_timeout)
        self.name = serve.get_replica_context().replica_id.unique_id.encode()

    async def http(self, request: Forwarded) -> AsyncIterator[dict]:
        async for message in relay(self.app, request.scope(), request.body):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.name)]}
            yield message

    def check_health(self) -> None:  # Serve replaces a replica whose engine stopped
        problem = self.llm.problem()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self) -> None:
        self.llm.close()


class Front:
    """The HTTP ingress: each request forwarded whole to an engine replica, its answer streamed back."""

    def __init__(self, engine) -> None:
        self.engine = engine.options(stream=True)

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        client = (request.client.host, request.client.port) if request.client else None
        forwarded = Forwarded(request.method, request.url.path, request.scope["query_string"],
                              list(request.headers.raw), body, client, prompt_text(body))
        error: Exception | None = None
        for _ in range(START_TRIES):
            messages = self.engine.http.remote(forwarded)
            try:
                start, first = await _begun(messages)
                break
            except LOST as err:
                error = err
        else:
            return APIError(503, f"no engine replica could answer: {error}", "server_error").response()

        async def body_chunks() -> AsyncIterator[bytes]:
            yield first.get("body", b"")
            async for message in messages:
                if message.get("body"):
                    yield message["body"]

        if first.get("more_body", False):
            response = StreamingResponse(body_chunks(), status_code=start["status"])
        else:  # the whole answer is here: nothing left for a dying replica to cut
            response = Response(first.get("body", b""), status_code=start["status"])
        response.raw_headers = list(start.get("headers", []))
        return response


async def _begun(messages) -> tuple[dict, dict]:
    """An answer's start and its first body message: until both are here, a replica's death leaves it to retry."""
    start = await messages.__anext__()
    try:
        first = await messages.__anext__()
    except StopAsyncIteration:
        first = {"type": "http.response.body", "body": b"", "more_body": False}
    return start, first


def deploy(args: argparse.Namespace, engine_args: dict, model_name: str, api_key: str | None) -> None:
    serve.start(http_options={"host": args.host, "port": args.port})
    per_replica = engine_args["max_num_seqs"]  # requests a replica runs at once: its queue depth target
    engine = serve.deployment(EngineReplica).options(
        name=ENGINE, ray_actor_options=replica_resources(args), max_ongoing_requests=2 * per_replica,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
        **_scaling(args, per_replica))
    front = serve.deployment(Front).options(name=APP, num_replicas=1, ray_actor_options={"num_cpus": 0},
                                            max_ongoing_requests=args.limit_concurrency)
    serve.run(front.bind(engine.bind(args.model, engine_args, model_name, api_key, args.max_body_bytes,
                                     args.chat_template, args.read_timeout)),
              name=APP, route_prefix="/", blocking=False)


def _scaling(args: argparse.Namespace, per_replica: int) -> dict:
    if args.min_replicas is None and args.max_replicas is None:
        return {"num_replicas": args.replicas}
    low = args.min_replicas if args.min_replicas is not None else 1
    high = args.max_replicas if args.max_replicas is not None else max(low, args.replicas)
    return {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                   "initial_replicas": min(max(args.replicas, low), high),
                                   "target_ongoing_requests": per_replica}}


def serve_replicas(args: argparse.Namespace, engine_args: dict, model_name: str, api_key: str | None) -> None:
    """Deploy on args.ray_address's cluster (None: a local one) and serve until SIGINT or SIGTERM."""
    stop = threading.Event()
    with ray_cluster(args.ray_address, quiet=False):
        for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
            signal.signal(signum, lambda *_: stop.set())
        deploy(args, engine_args, model_name, api_key)
        try:
            stop.wait()
        finally:
            if args.ray_address is not None:  # a local cluster ends with its processes, the application with it
                serve.delete(APP)
