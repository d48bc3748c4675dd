"""No input crashes the server: schemathesis generates requests from the server's own OpenAPI schema (valid
ones and ones that break it) for every operation; none may answer 5xx, the server stays healthy, and
every KV block is free after. A tiny context (32 positions) bounds the work any valid request can ask for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_server import MODEL, Served, run_server, wait_idle

from minigpt import AsyncLLM
from minigpt.server.app import build_app
from minigpt.server.chat_template import ChatTemplate

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = 25  # per operation and mode
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def served(checkpoint_factory) -> Iterator[Served]:
    checkpoint: Path = checkpoint_factory(n_positions=32)
    with AsyncLLM(str(checkpoint), kv_cache_tokens=4096) as llm:
        with run_server(build_app(llm, MODEL, chat_template=ChatTemplate(TEMPLATE))) as url:
            yield Served(url, llm)


@pytest.fixture(scope="module")
def schema(served):
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_describes_every_route(schema):
    paths = {f"{op.method.upper()} {op.path}" for op in operations(schema)}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "POST /tokenize",
            "POST /detokenize", "GET /tokenizer_info", "GET /health", "GET /metrics"} <= paths


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx(served, schema, mode):
    failures: list[str] = []
    for operation in operations(schema):
        if mode == GenerationMode.NEGATIVE and not len(operation.body):
            continue  # nothing to break in a request without a body (GET /health)

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case) -> None:
            response = case.call(base_url=served.url, timeout=60)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}")

        fuzz()
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    assert wait_idle(served.llm).kv_blocks_used == 0
    assert served.llm.kv_cache_info["blocks_in_use"] == 0
