"""The demo model shipped inside the package (minigpt/demo_model, its MODEL_CARD.md): what runs when no model is
named, so a fresh install prints text with no download."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEMO_MODEL = str(Path(__file__).resolve().parent / "demo_model")
MODEL_HELP = ("hub id (gpt2, gpt2-medium, ...) or a local checkpoint dir; default: the demo model shipped with "
              "minigpt (a 4-layer GPT-2 trained on Python's documentation)")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=MODEL_HELP)


def model_or_demo(model: str | None, prog: str, quiet: bool = False) -> str:
    """`model`, or the demo model when none was named, said on stderr unless `quiet`."""
    if model is not None:
        return model
    if not quiet:
        print(f"{prog.removeprefix('python -m ')}: no --model given, using the demo model {DEMO_MODEL}",
              file=sys.stderr)
    return DEMO_MODEL
