"""`python -m minigpt.batch`: a file of OpenAI Batch requests answered into a file of results.

    python -m minigpt.batch --model gpt2 -i requests.jsonl -o results.jsonl [--max-in-flight 1024 ...]

Each input line is `{"custom_id": ..., "method": "POST", "url": "/v1/completions" or "/v1/chat/completions",
"body": {...}}`, the body as the server takes it; each output line is `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, the body what the server would answer. Every line is in
flight at once, up to --max-in-flight, and results are appended as they complete, in that order.
Run it again with the same output file and it does only what is missing (after a crash, a kill or
Ctrl-C), so the output ends with every custom_id once. `-` reads stdin / writes stdout.
Needs the `server` extra: pip install "minigpt[server]". More in docs/batch.md; `--replicas N` runs the job on
N engine replicas on a Ray cluster (the `ray` extra): docs/ray.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from minigpt.cli import OneLineParser, add_engine_arguments, engine_args_from, flag_error_line
from minigpt.common.errors import USER_ERRORS
from minigpt.common.progress import PREFIX, log_to_stderr
from minigpt.demo import add_model_argument, model_or_demo
from minigpt.model.weights import resolve_checkpoint
from minigpt.replicas.options import MISSING_RAY, add_replica_arguments, ray_missing, replica_problem, uses_ray
from minigpt.serve import MISSING_EXTRA, served_name

if TYPE_CHECKING:
    from minigpt.batch_jobs.answer import Answerer
    from minigpt.batch_jobs.files import ResultWriter

DEFAULT_MAX_IN_FLIGHT = 1024
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def build_parser(prog: str = "python -m minigpt.batch") -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Answer a file of OpenAI Batch requests (/v1/completions, "
                           "/v1/chat/completions) into a file of results; rerun to resume. Needs the server extra: "
                           'pip install "minigpt[server]".')
    add_model_argument(parser)
    parser.add_argument("-i", "--input", required=True, metavar="FILE",
                        help="requests, one JSON line each ('-': stdin)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="results, appended; what it holds already is skipped ('-': stdout, no resuming)")
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, metavar="N",
                        help="engine requests (and lines) in flight at once (%(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name bodies may give (default: a hub id as given, a checkpoint's folder name)")
    parser.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                        help="Jinja chat template for /v1/chat/completions (default: the checkpoint's, if it has one)")
    parser.add_argument("--summary-json", type=Path, default=None, metavar="FILE",
                        help="write the summary (requests, failures, tokens, wall time) as JSON to FILE")
    parser.add_argument("--quiet", action="store_true", help="no engine report, progress or summary on stderr")
    add_engine_arguments(parser)
    add_replica_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m minigpt.batch") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    name = prog.removeprefix("python -m ")
    if args.max_in_flight < 1:
        parser.error(f"--max-in-flight must be a positive number, got {args.max_in_flight}")
    if args.input != "-" and args.output != "-" and _same_file(args.input, args.output):
        parser.error(f"-i and -o are the same file: {args.input}")
    if (problem := replica_problem(args)) is not None:
        parser.error(problem)
    if ray_missing(args):
        print(f"{name}: error: {MISSING_RAY}", file=sys.stderr)
        return 2
    try:
        import jinja2  # noqa: F401  (the server extra)

        from minigpt.batch_jobs import files
        from minigpt.batch_jobs.answer import Answerer
        from minigpt.batch_jobs.window import Window
        from minigpt.server.chat_template import ChatTemplate
        from minigpt.server.protocol import MAX_CHOICES
    except ImportError as err:
        print(f"{name}: error: {MISSING_EXTRA} (missing: {err.name})", file=sys.stderr)
        return 2
    if not args.quiet:
        log_to_stderr(logging.INFO)
    from minigpt.async_llm.async_engine import AsyncLLM

    engine_args = engine_args_from(args)
    # the window holds at most max_in_flight prompts, or one request alone (MAX_CHOICES at most): never a refusal
    engine_args["max_waiting"] = max(engine_args["max_waiting"], args.max_in_flight, MAX_CHOICES)
    args.model = model_or_demo(args.model, prog, args.quiet)  # said once the flags are known good
    model_name = args.served_model_name or served_name(args.model)
    writer = None
    with ExitStack() as resources:
        try:
            if args.summary_json is not None:
                files.check_writable(args.summary_json, "--summary-json")
            writer = files.ResultWriter(args.output)  # first: no other job may write it while this one reads it
            resources.callback(writer.close)
            done = files.resume_output(args.output) if args.output != "-" else set()
            total = None if files.read_once(args.input) else files.scan_input(args.input, done)
            stream = files.open_input(args.input)
            if stream is not sys.stdin.buffer:
                resources.callback(stream.close)
            if uses_ray(args):
                from minigpt.replicas.batch import replica_answerer

                answerer = resources.enter_context(replica_answerer(args, engine_args, model_name))
            else:
                template = ChatTemplate.for_checkpoint(resolve_checkpoint(args.model), args.chat_template)
                llm = resources.enter_context(AsyncLLM(args.model, **engine_args))
                answerer = Answerer(llm, model_name, template, Window(args.max_in_flight))
        except (*USER_ERRORS, KeyboardInterrupt) as err:
            if writer is not None:
                writer.abandon()
            if isinstance(err, KeyboardInterrupt):
                return 130
            print(f"{name}: error: {flag_error_line(err)}", file=sys.stderr)
            return 2
        return _run(args, name, answerer, stream, writer, done, total)


def _run(args: argparse.Namespace, name: str, answerer: Answerer, stream: BinaryIO, writer: ResultWriter,
         done: set[int], total: int | None) -> int:
    from minigpt.batch_jobs.files import numbered_lines
    from minigpt.batch_jobs.job import EngineStopped, RepeatedCustomId, Summary, run_job
    from minigpt.common.progress import Progress

    summary = Summary()
    progress = Progress(total, enabled=not args.quiet)
    code, error = 0, None
    try:
        async def job() -> None:
            await _until_stopped(run_job(answerer, numbered_lines(stream), done, writer, progress, summary,
                                         args.max_in_flight, args.input if args.input != "-" else "stdin",
                                         check_repeats=total is None), summary)

        asyncio.run(job())
    except RepeatedCustomId as err:
        code, error = 2, str(err)
    except EngineStopped as err:
        code, error = 1, f"{err}; what is left is not written: run it again"
    except BrokenPipeError:  # stdout's reader left (| head): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as err:  # writing the output failed (a full disk)
        code, error = 1, f"cannot write -o {args.output}: {err.strerror or err}"
    finally:
        progress.close()
        writer.flush()
        summary.finish()
    if error is not None:
        print(f"{name}: error: {error}", file=sys.stderr)
    if summary.stopped_by is not None:
        code = 128 + signal.Signals[summary.stopped_by]
    if not args.quiet:
        stopped = f"; stopped by {summary.stopped_by}: run it again to finish" if summary.stopped_by else ""
        print(f"{PREFIX}{summary.line(args.output)}{stopped}", file=sys.stderr)
    if args.summary_json is not None:
        try:
            args.summary_json.write_text(json.dumps(summary.as_json(), indent=2) + "\n", encoding="utf-8")
        except OSError as err:  # it was writable when the job began
            print(f"{name}: error: cannot write --summary-json {args.summary_json}: {err.strerror or err}",
                  file=sys.stderr)
            code = code or 1
    return code


async def _until_stopped(work, summary) -> None:
    """`work`, cancelled on SIGINT or SIGTERM (whose name goes into the summary)."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()

    def stop(signum: signal.Signals) -> None:
        summary.stopped_by = signum.name
        task.cancel()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop, signum)
    try:
        await task
    except asyncio.CancelledError:
        if summary.stopped_by is None:
            raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
