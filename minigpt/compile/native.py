"""The C++ kernels of kernels/: each built into a library of torch ops once per source, flags, torch and compiler,
into `native/` of the compile cache (a private folder, each library signed with this user's cache key as the
compiled steps are), then loaded with `torch.ops.load_library`. Where the cache cannot be trusted the library is
built for this process alone."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt.common.errors import error_line
from minigpt.common.progress import announce
from minigpt.compile.cache import default_cache_dir
from minigpt.compile.trust import Untrusted, check_private, private_folder, sign, signed_by, user_key

logger = logging.getLogger("minigpt")

FOLDER = "native"  # in the compile cache; prune leaves it (its names are no entry keys)
STANDARD = "-std=c++20"  # as inductor builds its CPU code


def load_library(source: Path, flags: tuple[str, ...]) -> None:
    """Load the ops `source` defines, built with `flags` (e.g. `-mavx2`); RuntimeError if the build fails."""
    command = _command(source, flags, cpp_compiler())
    key = hashlib.sha256(json.dumps({
        "source": hashlib.sha256(source.read_bytes()).hexdigest(), "command": command, "torch": torch.__version__,
        "torch_git": torch.version.git_version, "compiler": compiler_version(command[0]),
    }).encode()).hexdigest()[:32]
    name = f"{source.stem}-{key}"
    try:
        folder = default_cache_dir() / FOLDER
        private_folder(folder)
        secret = user_key()
    except (Untrusted, OSError) as err:
        logger.warning("compile cache not used (%s): building %s for this process alone", error_line(err), source.name)
        with tempfile.TemporaryDirectory() as scratch:  # the loaded library stays mapped once its file is gone
            torch.ops.load_library(_build(source, command, Path(scratch) / f"{name}.so"))
        return
    library, signature = folder / f"{name}.so", folder / f"{name}.hmac"
    if not _signed(library, signature, secret):
        built = _build(source, command, folder / f".{name}.{os.getpid()}.so")
        scratch = folder / f".{name}.{os.getpid()}.hmac"
        scratch.write_text(sign(secret, built.read_bytes()))
        os.replace(built, library)
        os.replace(scratch, signature)
    torch.ops.load_library(str(library))


def loads(source: Path, flags: tuple[str, ...], instead: str, fakes: dict[str, Callable]) -> bool:
    """`load_library`, then each op's fake (its output's shape, for compile) registered: False where the library
    fails (no compiler, a failed build, a library that will not load) with a warning saying what runs `instead`."""
    try:
        load_library(source, flags)
    except Exception as err:
        logger.warning("the C++ kernel %s is not used (%s instead): %s", source.name, instead, error_line(err))
        return False
    for op, fake in fakes.items():
        torch.library.register_fake(op, fake)
    return True


def cpp_compiler() -> str:
    """Inductor's C++ compiler ($CXX, else the first it finds): the one the compiled steps need anyway."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


@functools.cache
def compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"no usable C++ compiler ({compiler}): {error_line(err)}") from None


def _signed(library: Path, signature: Path, secret: bytes) -> bool:
    try:
        check_private(library, library.lstat())
        return library.is_file() and signed_by(secret, library.read_bytes(), signature.read_text())
    except (OSError, Untrusted):
        return False


def _command(source: Path, flags: tuple[str, ...], compiler: str) -> list[str]:
    """The compiler's command for `source`, less its output: the key of the library names all of it."""
    from torch.utils import cpp_extension

    return [
        compiler, "-O3", "-fPIC", "-shared", "-fopenmp", STANDARD, *flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp_extension.include_paths()), str(source),
        *(f"-L{path}" for path in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu",
    ]


def _build(source: Path, command: list[str], out: Path) -> Path:
    announce(logger, "building the C++ kernel %s (once for this torch and compiler)", source.name)
    start = time.perf_counter()
    done = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
        raise RuntimeError(f"building {source.name} failed: {errors[0] if errors else done.returncode}")
    logger.info("built %s in %.1f s", out.name, time.perf_counter() - start)
    return out
