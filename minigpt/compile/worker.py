"""`python -m minigpt.compile.worker SPEC PACKAGE THREADS PARENT`: one compiled step built in a process of
its own, so that a first start builds its steps side by side on as many cores (`compile_cache`).

SPEC: a `compile_cache.ProgramSpec` saved with `torch.save`; PACKAGE: the .pt2 to write; THREADS: the
parent's torch threads, which inductor writes into the parallel loops; PARENT: the parent's pid.
The worker leads a process group of its own, which it ends (itself and its compilers) on SIGTERM,
SIGINT or SIGHUP, and when its parent dies (Linux).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys

import torch

from minigpt.compile.cache import ProgramSpec, compile_program

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


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def end_with_parent(parent: int) -> None:
    """End this worker's process group on SIGTERM, SIGINT or SIGHUP, and have the death of `parent`
    (the process that started it) send SIGTERM."""
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
