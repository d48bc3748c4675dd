"""`python -m minigpt.compile_worker SPEC PACKAGE THREADS`: one compiled step built in a process of its
own, so that a first start builds its steps side by side on as many cores (`compile_cache`).

SPEC: a `compile_cache.ProgramSpec` saved with `torch.save`; PACKAGE: the .pt2 to write; THREADS: the
parent's torch threads, which inductor writes into the parallel loops.
"""

from __future__ import annotations

import sys

import torch

from minigpt.compile_cache import compile_program


def main(argv: list[str]) -> int:
    spec_path, package_path, threads = argv
    torch.set_num_threads(int(threads))
    spec = torch.load(spec_path, weights_only=False)  # minigpt's own file, written by its parent
    compile_program(spec, package_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
