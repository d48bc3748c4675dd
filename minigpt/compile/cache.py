"""The compiled steps on disk: each step exported once (`torch.export`), compiled ahead of time by
AOTInductor into a package, and loaded in milliseconds on every later start.

A cache entry is a folder named by a digest of everything the compiled code depends on (`entry_key`):
minigpt's own source, the torch build, the CPU and its threads, the model's config and the mode.
Never the weights: the programs take them as inputs (`compiled.TensorsAsInputs`), so one entry serves
every checkpoint of a shape and the weights are held once. An entry is written under a temporary name
and renamed when complete; its manifest records the key and each package's SHA-256, all checked
before any package is loaded, so a partial, stale or corrupt entry is rebuilt, never run. A load marks
its entry used (the manifest's time); every start deletes the entries of other minigpt sources or torch
builds (which this one never loads) that no engine has loaded for `UNUSED_DAYS` days, and the leftovers
of builds killed half way.

The packages hold native code (`cache_trust`): a cache folder another user could write, or with a key
others could read, is left alone, with a warning, and the steps are built for the engine alone; an
entry is loaded only if its folder is as private and its manifest is signed with the user's key, and
then from the bytes its SHA-256 were checked on.

A first start builds the steps side by side, each in a process of its own (`minigpt.compile.worker`),
as many at once as the CPU has cores: a build is mostly one thread of Python, then one of the C++
compiler. Each worker leads a process group of its own (it and its compilers), ended when the build
ends, fails or is interrupted, or the engine's process dies.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from minigpt.common.progress import announce
from minigpt.compile.trust import Untrusted, check_private, private_folder, sign, signed_by, user_key
from minigpt.engine.config import error_line
from minigpt.model.linears import x86_flags

logger = logging.getLogger("minigpt")

CACHE_DIR_ENV = "MINIGPT_CACHE_DIR"
MANIFEST = "manifest.json"
FORMAT = 2  # the layout of an entry; a change renames every entry
# inductor's generated code checks every input's size and strides on each call, nearly all of them
# weights whose shapes the entry's key fixes
PACKAGE_OPTIONS = {"size_asserts": False}
UNUSED_DAYS = 30  # an entry of another build no engine loaded for this long is deleted by the next build
BUILD_FIELDS = ("format", "minigpt", "torch", "torch_git")  # of a description: the build that wrote it
BUILDING = ".building-"  # in the name of a folder an entry is being built in, then its builder's pid and host
ABANDONED_HOURS = 24  # a build folder this old belongs to a build that was killed, wherever it ran
# what prune may delete: entries (named by `entry_key`) and build folders, nothing else a shared folder holds
PRUNABLE = re.compile(rf"[0-9a-f]{{32}}({re.escape(BUILDING)}.*)?")


def default_cache_dir() -> Path:
    """$MINIGPT_CACHE_DIR, else minigpt/compiled under $XDG_CACHE_HOME (default ~/.cache)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minigpt" / "compiled"


@dataclass
class ProgramSpec:
    """One step to export: `module(*inputs)`, with `dynamic_shapes` as `torch.export.export` takes them.
    The module holds no weights: they are among its inputs (`compiled.TensorsAsInputs`)."""

    name: str
    module: torch.nn.Module
    inputs: tuple
    dynamic_shapes: tuple


def source_digest() -> str:
    """A digest of minigpt's own Python source: any change to the code a step runs rebuilds it."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_environment(device: torch.device) -> dict:
    """What generated code depends on besides the model: torch's build, the CPU and the threads its
    parallel loops are written for, or the GPU."""
    flags = x86_flags()
    environment = {
        "format": FORMAT,
        "minigpt": source_digest(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest() if flags else None,
        "threads": torch.get_num_threads(),
        "device": device.type,
    }
    if device.type == "cuda":
        environment["gpu"] = torch.cuda.get_device_name(device)
    return environment


def entry_key(description: dict) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:32]


def _as_read_back(description: dict) -> dict:
    """`description` as its manifest will read it back (tuples as lists)."""
    return json.loads(json.dumps(description))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CorruptEntry(Exception):
    """A cache entry that must not be run: incomplete, written for another key, by another user, or altered."""


class ProgramCache:
    """Compiled step packages under `root`, one folder per entry key."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def load(
        self, description: dict, names: tuple[str, ...], specs: Callable[[], list[ProgramSpec]]
    ) -> tuple[dict[str, Callable], Path | None]:
        """The programs `names` of the entry for `description` and the entry's folder, built first if it is
        missing, stale, corrupt or incomplete. `specs()` makes what to export (only called to build). From a
        cache folder or key this user cannot trust, programs built for this caller alone (folder None)."""
        description = _as_read_back(description)
        try:
            private_folder(self.root)
            key = user_key()
        except (Untrusted, OSError) as err:
            logger.warning("compile cache not used (%s): building the steps for this engine alone", error_line(err))
            return self._build_privately(specs()), None
        self.prune(description)
        entry = self.root / entry_key(description)
        if entry.exists():
            start = time.perf_counter()
            _mark_used(entry)  # first: another process's prune spares it while it loads
            try:
                programs = self._load_entry(entry, description, names, key)
            except CorruptEntry as err:
                logger.warning("compile cache entry %s is unusable (%s): rebuilding it", entry, err)
                shutil.rmtree(entry, ignore_errors=True)
            else:
                logger.info("loaded the compiled steps from %s in %.2f s", entry, time.perf_counter() - start)
                return programs, entry
        self._build(entry, description, specs(), key)
        return self._load_entry(entry, description, names, key), entry

    def prune(self, description: dict) -> None:
        """Delete the entries of builds other than `description`'s unused for `UNUSED_DAYS` days (an entry
        of this build, even one served from a read-only cache that cannot be marked used, stays) and the
        folders of killed builds."""
        now, freed, removed = time.time(), 0, []
        for path in self.root.iterdir() if self.root.is_dir() else ():
            if not PRUNABLE.fullmatch(path.name) or not path.is_dir():
                continue
            building = BUILDING in path.name
            try:  # another process may be pruning the same folder
                if building:
                    stale = _builder_gone(path.name) or now - path.stat().st_mtime > ABANDONED_HOURS * 3600
                else:
                    built_by = json.loads((path / MANIFEST).read_text()).get("description", {})
                    stale = now - (path / MANIFEST).stat().st_mtime > UNUSED_DAYS * 86400 and any(
                        built_by.get(field) != description.get(field) for field in BUILD_FIELDS)
                size = sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) if stale else 0
            except (OSError, ValueError, AttributeError):
                continue  # gone, or no manifest a build of ours wrote
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    freed, removed = freed + size, removed + [path.name]
        if removed:
            logger.info("deleted %d compile cache folders (%.0f MB) of other builds unused for %d days or left by "
                        "killed builds: %s", len(removed), freed / 1e6, UNUSED_DAYS, ", ".join(removed))

    def _load_entry(self, entry: Path, description: dict, names: tuple[str, ...], key: bytes) -> dict[str, Callable]:
        """The entry's programs, once its folder, its manifest's signature, description and list of
        packages, and every package are checked."""
        try:
            check_private(entry, entry.lstat())
            manifest = json.loads((entry / MANIFEST).read_text())
            files, body = manifest["files"], _signed_part(manifest["description"], manifest["files"])
        except Untrusted as err:
            raise CorruptEntry(str(err)) from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CorruptEntry(f"no readable manifest: {err}") from None
        if not signed_by(key, body, manifest.get("hmac")):
            raise CorruptEntry("its manifest is not signed with this user's cache key")
        if manifest["description"] != description:
            raise CorruptEntry("its manifest was written for another build")
        if not isinstance(files, dict) or sorted(files) != sorted(names):
            raise CorruptEntry(f"its manifest lists {sorted(files)}, not the steps {sorted(names)}")
        return _load_packages(entry, files)

    def _build(self, entry: Path, description: dict, specs: list[ProgramSpec], key: bytes) -> None:
        """Export and compile every program into a temporary folder, sign its manifest, rename it into place."""
        start = time.perf_counter()
        workers = build_workers(specs)
        announce(logger, "compiling %d steps for this model shape and mode (%d at a time), once: later starts "
                 "load them from %s", len(specs), workers, self.root)
        builder = f"{os.getpid()}-{socket.gethostname()}-"  # `_builder_gone` reads it back
        with _unwound_by_signals():
            building = Path(tempfile.mkdtemp(prefix=f"{entry.name}{BUILDING}{builder}", dir=self.root))
            try:
                files = _build_steps(specs, building, workers)
                manifest = {"description": description, "files": files,
                            "hmac": sign(key, _signed_part(description, files))}
                (building / MANIFEST).write_text(json.dumps(manifest, indent=1))
                try:
                    building.rename(entry)
                except OSError:  # another process finished the same entry first: its copy serves
                    pass
            finally:
                shutil.rmtree(building, ignore_errors=True)
        announce(logger, "compiled in %.0f s", time.perf_counter() - start)

    @staticmethod
    def _build_privately(specs: list[ProgramSpec]) -> dict[str, Callable]:
        """The programs of `specs`, built in a folder of this process's, loaded, and the folder deleted."""
        with _unwound_by_signals(), tempfile.TemporaryDirectory(prefix="minigpt-compile-") as folder:
            return _load_packages(Path(folder), _build_steps(specs, Path(folder), build_workers(specs)))


def _signed_part(description: dict, files: dict) -> bytes:
    """What an entry's signature covers: its description and each package's SHA-256."""
    return json.dumps({"description": description, "files": files}, sort_keys=True).encode()


def _load_packages(folder: Path, files: dict[str, str]) -> dict[str, Callable]:
    """The packages of `files` (name -> SHA-256) in `folder`, loaded from the bytes checked, all checked
    before any is loaded."""
    from torch._inductor import aoti_load_package

    packages = {}
    for name, digest in files.items():
        try:
            data = (folder / f"{name}.pt2").read_bytes()
        except OSError:  # missing, or deleted while read
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise CorruptEntry(f"{name}.pt2 is missing or altered")
        packages[name] = data
    programs = {}
    for name, data in packages.items():
        try:  # from the bytes checked: the file may change after
            programs[name] = aoti_load_package(io.BytesIO(data))
        except (RuntimeError, OSError) as err:
            raise CorruptEntry(f"{name}.pt2 does not load: {error_line(err)}") from err
    return programs


def _builder_gone(name: str) -> bool:
    """Whether the process a build folder's `name` names (its pid and host) is gone: only known on its host."""
    match = re.search(rf"{re.escape(BUILDING)}(\d+)-(.+)-[^-]*$", name)
    if match is None or match[2] != socket.gethostname():
        return False
    try:
        os.kill(int(match[1]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        pass
    return False


class _Signalled(BaseException):
    """A signal that ends the process, raised where the build is so its workers are ended and its folder deleted."""


@contextlib.contextmanager
def _unwound_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP, where nothing else handles them, unwind a build in the main thread (its `finally`
    clauses end the workers and delete its folder) and then end the process as they would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise _Signalled(signum)

    taken = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in taken:
        signal.signal(sig, unwind)
    try:
        yield
    except _Signalled as signalled:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signalled.args[0])
        raise
    finally:
        for sig in taken:
            signal.signal(sig, signal.SIG_DFL)


def _mark_used(entry: Path) -> None:
    """Record that `entry` was loaded now, so `ProgramCache.prune` keeps it (a read-only cache keeps
    its entries' build times)."""
    try:
        os.utime(entry / MANIFEST)
    except OSError:
        pass


def build_workers(specs: list[ProgramSpec]) -> int:
    """How many steps to build at once: one per core this process may use, on the CPU; one on a GPU."""
    devices = {tensor.device.type for tensor in pytree.tree_leaves([spec.inputs for spec in specs])
               if isinstance(tensor, torch.Tensor)}
    if devices != {"cpu"}:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(len(specs), cores))


def compile_program(spec: ProgramSpec, package: str | Path) -> str:
    """Export `spec` and compile it into the `package` file -> the package's SHA-256."""
    from torch._inductor import aoti_compile_and_package

    with warnings.catch_warnings(), torch.inference_mode():
        # deprecations inside torch's own export and packaging: not the user's concern
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated")
        exported = torch.export.export(spec.module, spec.inputs, dynamic_shapes=spec.dynamic_shapes)
        aoti_compile_and_package(exported, package_path=str(package), inductor_configs=dict(PACKAGE_OPTIONS))
    return _sha256(Path(package))


def _build_steps(specs: list[ProgramSpec], folder: Path, workers: int) -> dict[str, str]:
    """Build `specs` into `folder`, `workers` at a time -> each package's SHA-256 by name."""
    return (_build_one_by_one if workers == 1 else _build_side_by_side)(specs, folder, workers)


def _build_one_by_one(specs: list[ProgramSpec], folder: Path, workers: int) -> dict[str, str]:
    files = {}
    for number, spec in enumerate(specs, 1):
        announce(logger, "compiling step %d/%d (%s)", number, len(specs), spec.name)
        files[spec.name] = compile_program(spec, folder / f"{spec.name}.pt2")
    return files


def _build_side_by_side(specs: list[ProgramSpec], folder: Path, workers: int) -> dict[str, str]:
    """Each spec built by `minigpt.compile.worker` in a process group of its own, `workers` at a time."""
    package_root = str(Path(__file__).resolve().parent.parent)  # where this minigpt is imported from
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
                files[name] = _sha256(folder / f"{name}.pt2")
                announce(logger, "compiled step %s (%d/%d) in %.0f s", name, len(files), len(specs),
                         time.perf_counter() - started)
    finally:
        for process, log, _ in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the worker and its compilers
            process.wait()
            log.close()
    return {spec.name: files[spec.name] for spec in specs}
