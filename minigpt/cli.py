"""`minigpt COMMAND ...`: the console command the package installs, one command per front end.

    minigpt generate --model gpt2 --prompt "Hello"      the same as python -m minigpt.generate ...
    minigpt serve --model gpt2 --port 8000              python -m minigpt.serve ...
    minigpt precompile --model gpt2 --quantize w8a8     python -m minigpt.precompile ...
    minigpt batch --model gpt2 -i in.jsonl -o out.jsonl python -m minigpt.batch ...

A command is its module's `main(argv, prog)`: the same flags, help, errors and exit codes as the `python -m`
form, its program named `minigpt COMMAND`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from minigpt.common.version import __version__
from minigpt.engine.config import OneLineParser

# name: (module whose main(argv, prog) runs it, its line in `minigpt --help`)
COMMANDS = {
    "generate": ("minigpt.generate", "complete prompts: streamed, batched or beam searched"),
    "serve": ("minigpt.serve", "serve a model over the OpenAI API (the server extra)"),
    "precompile": ("minigpt.precompile", "build --compile's steps into the cache ahead of time"),
    "batch": ("minigpt.batch", "answer OpenAI Batch request files (the server extra)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="minigpt", description="A GPT-2 inference engine written from scratch in PyTorch.",
                           epilog="'minigpt <command> --help' lists that command's flags.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, summary) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = build_parser().parse_args(argv[:1]).command  # --help, --version, or no command or an unknown one: exits
    return importlib.import_module(COMMANDS[name][0]).main(argv[1:], prog=f"minigpt {name}")
