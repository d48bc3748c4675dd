"""Graceful shutdown: on SIGTERM `python -m minigpt.serve` stops accepting connections, lets the requests in
flight finish, cancels those still running after --shutdown-timeout (their KV blocks freed) and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from test_server import MODEL, N_POSITIONS, free_port, wait_idle

from minigpt import AsyncLLM
from minigpt.server.app import build_app
from minigpt.server.shutdown import DrainingServer

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "n": 2, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory(n_positions=N_POSITIONS)


def start_server(checkpoint: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minigpt.serve", "--model", str(checkpoint), "--port", str(port), "--threads", "1",
         "--served-model-name", MODEL, "--kv-cache-tokens", "16384", "--log-level", "info", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(6000):
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read()) from None
            time.sleep(0.02)
    proc.kill()
    raise AssertionError("the server did not start")


def refuses_connections(url: str) -> bool:
    """Polls until a new connection is refused (bounded); False if it never is. A connection the kernel queued
    just before the listening socket closed is reset unanswered: that one is not refused yet, so it polls on."""
    for _ in range(500):
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            return True
        except (httpx.ReadError, httpx.RemoteProtocolError):
            pass
        time.sleep(0.01)
    return False


def test_sigterm_lets_a_stream_in_flight_finish_and_exits_0(checkpoint):
    proc, url = start_server(checkpoint, "--shutdown-timeout", "120")
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=120) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            assert refuses_connections(url)
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(first.removeprefix("data: "))] + [json.loads(e) for e in rest[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finishes == ["length"] * LONG["n"]
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        proc.wait()
    log = proc.stdout.read()
    assert "Traceback" not in log, log


def finish_reasons(events: list[str]) -> list[str]:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


def test_sigterm_aborts_what_outlives_the_grace_period_and_exits_0(checkpoint):
    proc, url = start_server(checkpoint, "--shutdown-timeout", "0")
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "max_tokens": 1000, "n": 8},
                          timeout=120) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"  # the stream ends as streams do, each choice with finish_reason "abort"
        assert finish_reasons(rest) == ["abort"] * 8
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        proc.wait()
    log = proc.stdout.read()
    assert "Traceback" not in log and "ERROR" not in log, log


def test_requests_aborted_at_the_grace_period_free_their_blocks(checkpoint):
    """In process, where the pool can be read: the drain's deadline ends the stream and frees its blocks."""
    with AsyncLLM(str(checkpoint), kv_cache_tokens=16384) as llm:
        config = uvicorn.Config(build_app(llm, MODEL), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        server = DrainingServer(config, llm, grace=0.2)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        for _ in range(2000):
            if server.started:
                break
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "max_tokens": 1000, "n": 8},
                          timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert llm.metrics().kv_blocks_used > 0
            server.should_exit = True
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        thread.join(60)
        assert not thread.is_alive() and rest[-1] == "[DONE]"
        assert "abort" in finish_reasons(rest)
        assert wait_idle(llm).kv_blocks_used == 0
