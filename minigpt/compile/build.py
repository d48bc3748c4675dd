"""Building compiled steps: each exported (`torch.export`) and compiled by AOTInductor into a package, side by
side in worker processes (`minigpt.compile.worker`), each leading a process group ended with its build."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from minigpt.common.progress import announce

logger = logging.getLogger("minigpt")

# size_asserts: inductor's code would check every input's strides each call: nearly all weights, whose shapes the key
# fixes. The variance threshold: Welford's variance in every layernorm, as programs of one row take it (a two-pass one
# in the batched programs would give a row other bits alone than among others).
PACKAGE_OPTIONS = {"size_asserts": False, "cpp.use_two_step_variance_threshold": 0}


@dataclass
class ProgramSpec:
    """One step to export: `module(*inputs)` (no weights: they are inputs), with `torch.export`'s dynamic_shapes."""

    name: str
    module: torch.nn.Module
    inputs: tuple
    dynamic_shapes: tuple


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Signalled(BaseException):
    """A process-ending signal, raised so the build ends its workers and deletes its folder."""


@contextlib.contextmanager
def unwound_by_signals() -> Iterator[None]:
    """Unhandled SIGTERM and SIGHUP unwind a build in the main thread, then end the process as they would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise Signalled(signum)

    taken = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in taken:
        signal.signal(sig, unwind)
    try:
        yield
    except Signalled as signalled:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signalled.args[0])
        raise
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)


def build_workers(specs: list[ProgramSpec]) -> int:
    """Steps built at once: one per core this process may use on the CPU; one on a GPU."""
    devices = {tensor.device.type for tensor in pytree.tree_leaves([spec.inputs for spec in specs])
               if isinstance(tensor, torch.Tensor)}
    if devices != {"cpu"}:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(len(specs), cores))


def compile_program(spec: ProgramSpec, package: str | Path) -> str:
    from torch._inductor import aoti_compile_and_package

    with warnings.catch_warnings(), torch.inference_mode():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated")
        exported = torch.export.export(spec.module, spec.inputs, dynamic_shapes=spec.dynamic_shapes)
        aoti_compile_and_package(exported, package_path=str(package), inductor_configs=dict(PACKAGE_OPTIONS))
    return sha256_file(Path(package))


def build_steps(specs: list[ProgramSpec], folder: Path, workers: int) -> dict[str, str]:
    """-> each package's SHA-256 by name."""
    return (_build_one_by_one if workers == 1 else _build_side_by_side)(specs, folder, workers)


def _build_one_by_one(specs: list[ProgramSpec], folder: Path, workers: int) -> dict[str, str]:
    files = {}
    for number, spec in enumerate(specs, 1):
        announce(logger, "compiling step %d/%d (%s)", number, len(specs), spec.name)
        files[spec.name] = compile_program(spec, folder / f"{spec.name}.pt2")
    return files


def _build_side_by_side(specs: list[ProgramSpec], folder: Path, workers: int) -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parents[2])  # the folder this minigpt is imported from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    waiting, running, files = list(specs), {}, {}
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                spec = waiting.pop(0)
                torch.save(spec, folder / f"{spec.name}.spec")
                log = open(folder / f"{spec.name}.log", "w+")  # noqa: SIM115 - closed when the process ends
                command = [sys.executable, "-m", "minigpt.compile.worker", str(folder / f"{spec.name}.spec"),
                           str(folder / f"{spec.name}.pt2"), str(torch.get_num_threads()), str(os.getpid())]
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
                running[spec.name] = (process, log, time.perf_counter())
            time.sleep(0.05)
            for name, (process, log, started) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[name]
                log.seek(0)
                lines = [line for line in log.read().splitlines() if line.strip()]
                log.close()
                for scratch in (f"{name}.spec", f"{name}.log"):  # the entry holds packages and manifest only
                    (folder / scratch).unlink()
                if process.returncode:
                    raise RuntimeError(f"compiling step {name} failed: {lines[-1] if lines else process.returncode}")
                files[name] = sha256_file(folder / f"{name}.pt2")
                announce(logger, "compiled step %s (%d/%d) in %.0f s", name, len(files), len(specs),
                         time.perf_counter() - started)
    finally:
        for process, log, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the worker and its compilers
            process.wait()
            log.close()
    return {spec.name: files[spec.name] for spec in specs}
