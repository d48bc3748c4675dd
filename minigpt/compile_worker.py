"""`python -m minigpt.compile_worker SPEC PACKAGE THREADS`: one compiled step built in a process of its
own, so that a first start builds its steps side by side on as many cores (`compile_cache`).

SPEC: a `compile_cache.ProgramSpec` saved with `torch.save`; PACKAGE: the .pt2 to write; THREADS: the
parent's torch threads, which inductor writes into the parallel loops.
"""

from __future__ import annotations

import importlib
import sys

import torch

from minigpt.compile_cache import ProgramSpec, compile_program

# What a spec is made of: minigpt's modules and functions, torch's modules, export's dims and bounds
SPEC_MODULES = ("minigpt.", "torch.nn.modules.", "torch.export.dynamic_shapes.", "torch.utils._sympy.")


def load_spec(path: str) -> ProgramSpec:
    """The spec in `path`, unpickled with `weights_only=True`: only the objects of `SPEC_MODULES` it
    names are allowed, so no other code runs."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    foreign = [name for name in names if not name.startswith(SPEC_MODULES)]
    if foreign:
        raise ValueError(f"{path} names objects a compiled step is not made of: {', '.join(foreign)}")
    allowed = [getattr(importlib.import_module(module), attr) for module, _, attr in (n.rpartition(".") for n in names)]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def main(argv: list[str]) -> int:
    spec_path, package_path, threads = argv
    torch.set_num_threads(int(threads))
    compile_program(load_spec(spec_path), package_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
