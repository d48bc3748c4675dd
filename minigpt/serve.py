"""`python -m minigpt.serve`: an OpenAI-compatible HTTP server for one GPT-2 model.

    python -m minigpt.serve --model gpt2 [--port 8000 --api-key KEY --chat-template FILE --dtype bfloat16 ...]

Loads the model, then serves POST /v1/completions, POST /v1/chat/completions, GET /v1/models, the
tokenizer endpoints, /health and /metrics on 127.0.0.1 (pass --host 0.0.0.0 to listen on every
interface). Needs the `server` extra.

With --replicas N (the `ray` extra) it runs N engine replicas as a Ray Serve application: docs/ray.md.

On SIGTERM (or Ctrl-C) it stops accepting connections, lets the requests in flight finish for up to
--shutdown-timeout seconds, cancels those still running (their KV blocks freed) and exits 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from minigpt.cli import OneLineParser, add_engine_arguments, engine_args_from, flag_error_line
from minigpt.common.errors import USER_ERRORS
from minigpt.common.progress import log_to_stderr
from minigpt.demo import add_model_argument, model_or_demo
from minigpt.model.weights import resolve_checkpoint
from minigpt.replicas.options import (
    MISSING_RAY,
    add_autoscaling_arguments,
    add_replica_arguments,
    ray_missing,
    replica_problem,
    uses_ray,
)
from minigpt.server.limits import DEFAULT_LIMIT_CONCURRENCY, DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT

PROG = "python -m minigpt.serve"  # the console command passes its own: "minigpt serve"
MISSING_EXTRA = 'the server needs FastAPI, uvicorn and jinja2: pip install "minigpt[server]"'
API_KEY_ENV = "MINIGPT_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Serve GPT-2 over the OpenAI API.")
    add_model_argument(parser)
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    http.add_argument("--port", type=port_number, default=8000)
    key = http.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1 (ps shows it: "
                     f"prefer --api-key-file or ${API_KEY_ENV})")
    key.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                     help=f"read the API key from FILE (default: ${API_KEY_ENV}, if set)")
    http.add_argument("--served-model-name", default=None,
                      help="the model name clients send (default: a hub id as given, a local checkpoint's folder name)")
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      help="largest request body in bytes (%(default)s)")
    http.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT, metavar="SECONDS",
                      help="a client has this long to send a request's headers, and again its body (%(default)s)")
    http.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                      help="connections and requests in flight past which a new request gets 503 (%(default)s)")
    http.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                      help="Jinja chat template for /v1/chat/completions (default: the checkpoint's, if it has one)")
    http.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                      help="on SIGTERM, how long requests in flight may run before they are cancelled (%(default)s)")
    http.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(parser)
    add_replica_arguments(parser)
    add_autoscaling_arguments(parser)
    return parser


def port_number(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"a port is a number in [0, 65535], got {text!r}")
    return int(text)


def served_name(model: str) -> str:
    """What clients call `model` when --served-model-name is not given: a local checkpoint by its folder's name,
    so no answer shows where it lies on disk; a hub id (gpt2, openai-community/gpt2) as it is."""
    path = Path(model)
    return (path.resolve().name or model) if path.is_dir() else model


def api_key_from(args: argparse.Namespace) -> tuple[str | None, str]:
    """The API key (None: none) and where it came from: --api-key, --api-key-file (its text, without the
    surrounding whitespace), else the environment."""
    if args.api_key is not None:
        return args.api_key, "--api-key"
    if args.api_key_file is not None:
        where = f"--api-key-file {args.api_key_file}"
        try:
            return args.api_key_file.read_text(encoding="utf-8").strip(), where
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{where}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
    return os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}"


def check_can_listen(host: str, port: int) -> None:
    """Bind the address once before the model loads (minutes with --compile), as uvicorn will after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn sets it
        probe.bind((host, port))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.model = model_or_demo(args.model, prog)
    if args.max_body_bytes < 1:
        parser.error("--max-body-bytes must be a positive number of bytes")
    if not args.read_timeout > 0:
        parser.error(f"--read-timeout must be a number of seconds > 0, got {args.read_timeout}")
    if args.limit_concurrency < 1:
        parser.error(f"--limit-concurrency must be a positive number, got {args.limit_concurrency}")
    if not args.shutdown_timeout >= 0:
        parser.error(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if (problem := replica_problem(args)) is not None:
        parser.error(problem)
    if ray_missing(args):
        print(parser.error_line(MISSING_RAY), file=sys.stderr)
        return 2
    try:
        api_key, where = api_key_from(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        import jinja2  # noqa: F401  (the server extra, checked here even when its modules are loaded already)
        import uvicorn  # noqa: F401

        from minigpt.server.app import build_app
        from minigpt.server.chat_template import ChatTemplate
        from minigpt.server.middleware import check_api_key
        from minigpt.server.shutdown import serve
    except ImportError as err:
        print(parser.error_line(f"{MISSING_EXTRA} (missing: {err.name})"), file=sys.stderr)
        return 2
    if api_key is not None:
        try:
            check_api_key(api_key)
        except ValueError as err:
            parser.error(f"{where}: {err}")
    from minigpt.async_llm.async_engine import AsyncLLM

    try:
        if args.ray_address is None:  # elsewhere, the cluster's head binds it
            check_can_listen(args.host, args.port)
    except OSError as err:
        print(parser.error_line(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}"), file=sys.stderr)
        return 2
    log_to_stderr(args.log_level.upper())
    model_name = args.served_model_name or served_name(args.model)
    try:
        template = ChatTemplate.for_checkpoint(resolve_checkpoint(args.model), args.chat_template)
        if uses_ray(args):
            from minigpt.replicas.cluster import prepare_local_cluster

            if args.ray_address is None:
                prepare_local_cluster()  # before ray.serve's import below
            from minigpt.replicas.serving import serve_replicas

            serve_replicas(args, engine_args_from(args), model_name, api_key)
            return 0
        llm = AsyncLLM(args.model, **engine_args_from(args))
    except USER_ERRORS as err:
        print(parser.error_line(flag_error_line(err)), file=sys.stderr)
        return 2
    try:
        app = build_app(llm, model_name, api_key, args.max_body_bytes, template, args.read_timeout)
        serve(app, llm, args.host, args.port, args.log_level, args.shutdown_timeout, args.read_timeout,
              args.limit_concurrency)
    finally:
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
