"""The command lines' shared pieces (one-line errors, engine flags generated from EngineConfig, fields named by
their flags) and the console command `minigpt generate | serve | precompile | batch | perplexity ...`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Mapping
from dataclasses import Field, fields
from typing import NoReturn

from minigpt.common.errors import Named, ParamError, error_line
from minigpt.common.version import __version__
from minigpt.engine.config import EngineConfig

# name: (module whose main(argv, prog) runs it, its line in `minigpt --help`)
COMMANDS = {
    "generate": ("minigpt.generate", "complete prompts: streamed, batched or beam searched"),
    "serve": ("minigpt.serve", "serve a model over the OpenAI API (the server extra)"),
    "precompile": ("minigpt.precompile", "build --compile's steps into the cache ahead of time"),
    "batch": ("minigpt.batch", "answer OpenAI Batch request files (the server extra)"),
    "perplexity": ("minigpt.perplexity", "a model's perplexity on a text file (held-out text)"),
}
# what a command reports in one line with exit code 2: bad arguments or checkpoint, no memory, a failed compile
class OneLineParser(argparse.ArgumentParser):
    def error_line(self, message: str) -> str:
        return f"{self.prog.removeprefix('python -m ')}: error: {message}"

    def error(self, message: str) -> NoReturn:
        self.exit(2, self.error_line(message) + " (see --help)\n")


def _flag(setting: Field) -> str | None:
    flag = setting.metadata["flag"]
    return "--" + setting.name.replace("_", "-") if flag == "" else flag


def engine_flags() -> dict[str, str]:
    return {setting.name: flag for setting in fields(EngineConfig) if (flag := _flag(setting)) is not None}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    for setting in fields(EngineConfig):
        flag, meta = _flag(setting), setting.metadata
        if flag is None:
            continue
        if setting.type == "bool":  # (annotations are strings here) a switch, off by default
            engine.add_argument(flag, action="store_true", help=meta["help"])
            continue
        kind = {"int": int, "dict": _json_object}.get(setting.type.split(" ")[0])  # None: the string as it is
        engine.add_argument(flag, type=kind, default=setting.default, choices=meta["choices"], help=meta["help"])


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_args_from(args: argparse.Namespace) -> dict:
    return {name: getattr(args, flag.removeprefix("--").replace("-", "_")) for name, flag in engine_flags().items()}


def flag_error_line(err: BaseException, flags: Mapping[str, str] | None = None) -> str:
    """`error_line(err)`, its fields named by their flags (the engine's and `flags`, field -> flag)."""
    if not isinstance(err, ParamError):
        return error_line(err)
    names = engine_flags() | dict(flags or {})

    def word(named: Named) -> str:
        flag = names.get(named.field)
        if flag is None:
            return err.api(named)
        return flag if named.value is ... or named.value is True else f"{flag}={named.value!r}"  # a switch: itself

    return error_line(ValueError(err.worded(word)))


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
