"""Faults an orchestrator or a hostile client brings, each reproduced on loopback servers of these tests and
shown held: /health tells an engine that cannot serve from one that can, with the reason; slow clients and
too many of them lose their connection or get 503; a key no client can send is refused; no answer shows
a local path; a client that leaves logs no traceback."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from test_server import MODEL, N_POSITIONS, Gate, Served, run_server, wait_idle

from minigpt import AsyncLLM, SamplingParams
from minigpt.server.app import build_app
from minigpt.server.connections import uvicorn_config


@pytest.fixture
def fragile(checkpoint_factory) -> Iterator[Served]:
    """An engine for one test, which may break it; a step counts as hung after a second."""
    with AsyncLLM(str(checkpoint_factory()), kv_cache_tokens=1024, hung_step_seconds=1) as llm:
        with run_server(build_app(llm, MODEL)) as url:
            yield Served(url, llm)


def health(served: Served) -> tuple[int, dict]:
    response = httpx.get(f"{served.url}/health")
    return response.status_code, response.json()


def wait_for_health(served: Served, status: int) -> dict:
    """The /health body once it answers `status` (bounded poll)."""
    for _ in range(1000):
        code, body = health(served)
        if code == status:
            return body
        time.sleep(0.01)
    raise AssertionError(f"/health still answers {code}: {body}")


def test_health_is_503_while_a_step_hangs(fragile, monkeypatch):
    gate = Gate(fragile.llm, monkeypatch)
    sender = threading.Thread(target=lambda: httpx.post(f"{fragile.url}/v1/completions",
                                                        json={"prompt": "hi", "max_tokens": 2}, timeout=None))
    sender.start()
    try:
        assert gate.entered.wait(60), "the request never reached the engine"
        body = wait_for_health(fragile, 503)
        assert body["status"] == "unhealthy" and "past hung_step_seconds=1" in body["reason"], body
    finally:
        gate.release()
        sender.join()
    assert health(fragile) == (200, {"status": "ok"})  # the step ended: the engine serves again


def test_health_is_503_once_the_engine_thread_fails(fragile, monkeypatch):
    def broken() -> bool:
        raise RuntimeError("injected loop fault")

    monkeypatch.setattr(fragile.llm, "_serve_once", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's own traceback
    fragile.llm.submit("hi", SamplingParams(max_tokens=1))  # the loop, waiting for work, goes round once more
    body = wait_for_health(fragile, 503)
    assert body == {"status": "unhealthy", "reason": "the engine thread failed: RuntimeError: injected loop fault"}
    response = httpx.post(f"{fragile.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 503


def test_health_names_a_runner_that_cannot_run(fragile, monkeypatch):
    monkeypatch.setattr(fragile.llm.engine.runner, "problem", lambda: "tensor-parallel rank 1 exited (exit code -9)")
    assert health(fragile) == (503, {"status": "unhealthy", "reason": "tensor-parallel rank 1 exited (exit code -9)"})


def test_health_is_503_after_close(fragile):
    fragile.llm.close()
    assert health(fragile) == (503, {"status": "unhealthy", "reason": "the engine is stopped"})


# -- the API key ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(checkpoint_factory) -> Iterator[AsyncLLM]:
    with AsyncLLM(str(checkpoint_factory(n_positions=N_POSITIONS)), kv_cache_tokens=4096) as llm:
        yield llm


@pytest.mark.parametrize("key", ["", " ", "two words", "clé", "tab\tkey"])
def test_a_key_no_client_can_send_is_refused(llm, key):
    """An empty key would let `Authorization: Bearer ` in; one with spaces or past ASCII could never match."""
    with pytest.raises(ValueError, match="an API key must be 1 or more visible ASCII characters"):
        build_app(llm, MODEL, api_key=key)


def assert_refused_in_one_line(capsys, argv: list[str], says: str) -> None:
    """`minigpt serve` with `argv` exits 2 before loading any model, saying `says` on one line."""
    from minigpt import serve

    with pytest.raises(SystemExit) as exited:
        serve.main(["--model", "/no/such/dir", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize(("argv", "env", "says"), [
    (["--api-key", ""], None, "--api-key: an API key must be 1 or more visible ASCII characters, without spaces "
                              "(it is empty)"),
    ([], "", "$MINIGPT_API_KEY: an API key must be"),
    (["--api-key-file", "/no/such/file"], None, "--api-key-file /no/such/file: cannot read it (No such file"),
    (["--api-key", "k", "--api-key-file", "f"], None, "not allowed with argument"),
])
def test_cli_refuses_a_bad_key_in_one_line_before_loading(monkeypatch, capsys, argv, env, says):
    if env is not None:
        monkeypatch.setenv("MINIGPT_API_KEY", env)
    assert_refused_in_one_line(capsys, argv, says)


def test_the_key_comes_from_the_flag_a_file_or_the_environment(monkeypatch, tmp_path):
    from minigpt import serve

    parse = serve.build_parser().parse_args
    monkeypatch.delenv("MINIGPT_API_KEY", raising=False)
    assert serve.api_key_from(parse([])) == (None, "$MINIGPT_API_KEY")
    monkeypatch.setenv("MINIGPT_API_KEY", "from-env")
    assert serve.api_key_from(parse([])) == ("from-env", "$MINIGPT_API_KEY")
    assert serve.api_key_from(parse(["--api-key", "flag"])) == ("flag", "--api-key")
    (tmp_path / "key").write_text("from-file\n")
    assert serve.api_key_from(parse(["--api-key-file", str(tmp_path / "key")]))[0] == "from-file"


# -- no local paths in answers ----------------------------------------------------------------------


def test_a_local_checkpoint_is_served_by_its_folder_name(tmp_path, monkeypatch):
    from minigpt.serve import served_name

    checkpoint = tmp_path / "ckpts" / "my-gpt2"
    checkpoint.mkdir(parents=True)
    assert served_name(str(checkpoint)) == served_name(f"{checkpoint}/") == "my-gpt2"
    monkeypatch.chdir(checkpoint.parent)
    assert served_name("my-gpt2") == served_name("./my-gpt2/") == "my-gpt2"
    monkeypatch.chdir(checkpoint)
    assert served_name(".") == "my-gpt2"
    assert served_name("gpt2") == "gpt2" and served_name("openai-community/gpt2") == "openai-community/gpt2"


# -- slow clients and too many of them --------------------------------------------------------------


@contextmanager
def run_configured(app, read_timeout: float, limit_concurrency: int = 512) -> Iterator[tuple[str, int]]:
    """The app under the CLI's uvicorn config on a free port; yields (host, port)."""
    config = uvicorn_config(app, "127.0.0.1", 0, "warning", read_timeout, limit_concurrency, 5)
    with run_server(app, config) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def read_until_closed(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (the socket's timeout, far past the server's,
    bounds a wait on a server that never closes)."""
    sock.settimeout(60)
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def read_response(sock: socket.socket) -> bytes:
    """One whole response (its headers, then Content-Length bytes of body)."""
    sock.settimeout(60)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


def test_a_client_slow_with_its_headers_or_its_body_loses_its_connection(llm):
    with run_configured(build_app(llm, MODEL, read_timeout=0.5), read_timeout=0.5) as address:
        with socket.create_connection(address) as slowloris:  # half its headers, then nothing
            slowloris.sendall(HEAD)
            assert read_until_closed(slowloris) == b""
        with socket.create_connection(address) as silent:  # connects, sends nothing
            assert read_until_closed(silent) == b""
        with socket.create_connection(address) as short:  # announces 1,000 bytes, sends 10
            short.sendall(HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
            answer = read_until_closed(short)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within the server's 0.5 s" in answer
        with socket.create_connection(address) as kept:  # a whole request, then half the next one's headers
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert read_response(kept).startswith(b"HTTP/1.1 200 ")
            kept.sendall(b"GET /health HTTP/1.1\r\n")
            assert read_until_closed(kept) == b""
        with socket.create_connection(address) as prompt:  # headers and body in pieces, each in time
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            for piece in (HEAD, b"Content-Length: %d\r\n\r\n" % len(body), body[:5], body[5:]):
                prompt.sendall(piece)
            assert read_response(prompt).startswith(b"HTTP/1.1 200 ")


def poll(url: str, status: int) -> httpx.Response:
    """GET `url` until it answers `status` (a bounded poll: the server takes and drops connections as it goes)."""
    for _ in range(500):
        if (response := httpx.get(url)).status_code == status:
            break
        time.sleep(0.01)
    return response


def test_requests_past_the_concurrency_limit_get_503(llm):
    with run_configured(build_app(llm, MODEL), read_timeout=60, limit_concurrency=3) as address:
        url = f"http://{address[0]}:{address[1]}/health"
        assert httpx.get(url).status_code == 200
        idle = [socket.create_connection(address) for _ in range(3)]
        refused = poll(url, 503)  # 3 open and this request's: past the limit
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "concurrency_limit"
        assert "--limit-concurrency" in refused.json()["error"]["message"]
        idle.pop().close()
        assert poll(url, 200).status_code == 200  # 2 open and this request's: at the limit, served
        for sock in idle:
            sock.close()
        assert poll(url, 200).status_code == 200


@pytest.mark.parametrize(("argv", "says"), [
    (["--read-timeout", "0"], "--read-timeout must be a number of seconds > 0, got 0.0"),
    (["--limit-concurrency", "0"], "--limit-concurrency must be a positive number, got 0"),
])
def test_cli_refuses_bad_connection_limits_before_loading(capsys, argv, says):
    assert_refused_in_one_line(capsys, argv, says)


# -- log noise --------------------------------------------------------------------------------------


def test_a_client_leaving_a_plain_request_logs_no_traceback(llm, caplog):
    """Each disconnect is at most one line (uvicorn's access line), never asyncio's 'exception was never
    retrieved' with a CancelledError traceback."""
    caplog.set_level(logging.INFO)

    async def leave(url: str) -> None:
        before = llm.metrics().requests_total
        body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True}
        async with httpx.AsyncClient() as client:
            request = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
            for _ in range(2000):  # until the engine has the request (a bounded poll)
                if llm.metrics().requests_total > before:
                    break
                await asyncio.sleep(0.01)
            request.cancel()  # drops the connection
            with pytest.raises(asyncio.CancelledError):
                await request

    with run_server(build_app(llm, MODEL)) as url:
        for _ in range(3):
            caplog.clear()
            asyncio.run(leave(url))
            wait_idle(llm)
            gc.collect()  # asyncio logs an unretrieved exception when its future is collected
            noisy = [r for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()]
            assert not noisy, [r.getMessage() for r in noisy]
            server = [r for r in caplog.records if r.levelno >= logging.INFO
                      and r.name.split(".")[0] in ("minigpt", "uvicorn", "asyncio", "starlette", "fastapi")]
            assert len(server) <= 1, [r.getMessage() for r in server]
