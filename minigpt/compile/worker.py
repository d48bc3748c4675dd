"""`python -m minigpt.compile.worker SPEC PACKAGE THREADS PARENT`: one step built in a process of its own (build.py).

SPEC: a saved `ProgramSpec`; PACKAGE: the .pt2 to write; THREADS: the parent's torch threads (inductor writes
them into its loops); PARENT: the parent's pid. It ends its process group on a signal or its parent's death."""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys

import torch

from minigpt.compile.build import ProgramSpec, compile_program

# What a spec is made of: minigpt's modules and functions, torch's modules, export's dims and bounds
SPEC_MODULES = ("minigpt.", "torch.nn.modules.", "torch.export.dynamic_shapes.", "torch.utils._sympy.")


def load_spec(path: str) -> ProgramSpec:
    """The spec in `path`, unpickled allowing only the objects of `SPEC_MODULES` it names."""
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    foreign = [name for name in names if not name.startswith(SPEC_MODULES)]
    if foreign:
        raise ValueError(f"{path} names objects a compiled step is not made of: {', '.join(foreign)}")
    allowed = [getattr(importlib.import_module(module), attr) for module, _, attr in (n.rpartition(".") for n in names)]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def end_with_parent(parent: int) -> None:
    """End this worker's group on SIGTERM, SIGINT or SIGHUP, and on the death of `parent`."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _end_group)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        _end_group()


def _end_group(*_) -> None:
    try:
        os.killpg(os.getpid(), signal.SIGKILL)  # the group this worker leads: it and its compilers
    finally:
        os._exit(1)  # reached only if this worker leads no group


def main(argv: list[str]) -> int:
    spec_path, package_path, threads, parent = argv
    end_with_parent(int(parent))
    torch.set_num_threads(int(threads))
    compile_program(load_spec(spec_path), package_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
