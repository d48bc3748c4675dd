"""The compiled steps on disk, one folder per `entry_key` (minigpt's source, torch, the CPU, the model's shape and
mode; not the weights), renamed into place when complete. Its signed manifest lists each package's SHA-256: an
entry partial, stale, altered or not this user's is rebuilt, never run."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt import kernels
from minigpt.common.cpu_class import x86_flags
from minigpt.common.errors import error_line
from minigpt.common.progress import announce
from minigpt.compile.build import ProgramSpec, build_steps, build_workers, unwound_by_signals
from minigpt.compile.trust import Untrusted, check_private, private_folder, sign, signed_by, user_key

logger = logging.getLogger("minigpt")

CACHE_DIR_ENV = "MINIGPT_CACHE_DIR"
MANIFEST = "manifest.json"
FORMAT = 2  # the layout of an entry; a change renames every entry
UNUSED_DAYS = 30
BUILD_FIELDS = ("format", "minigpt", "torch", "torch_git")  # the build that wrote a description
BUILDING = ".building-"  # in a build folder's name, then its builder's pid and host
ABANDONED_HOURS = 24  # a build folder this old was left by a killed build
# what prune may delete: entries and build folders, nothing else a shared folder holds
PRUNABLE = re.compile(rf"[0-9a-f]{{32}}({re.escape(BUILDING)}.*)?")


def default_cache_dir() -> Path:
    """$MINIGPT_CACHE_DIR, else minigpt/compiled under $XDG_CACHE_HOME (default ~/.cache)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minigpt" / "compiled"


def source_digest() -> str:
    """Of minigpt's Python and its kernels' sources (the C++ ops a program calls by their schema): the same in a
    source tree (kernels/ beside minigpt/) and a wheel (minigpt/kernels/)."""
    digest = hashlib.sha256()
    for name, path in sorted(_sources()):
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _sources():
    root = Path(__file__).resolve().parents[1]
    kernel_root = Path(kernels.__file__).resolve().parent
    for path in root.rglob("*.py"):
        if kernel_root not in path.parents:
            yield path.relative_to(root).as_posix(), path
    for path in kernel_root.rglob("*"):
        if path.suffix in (".py", ".cpp"):
            yield f"kernels/{path.relative_to(kernel_root).as_posix()}", path


def build_environment(device: torch.device) -> dict:
    """What generated code depends on besides the model."""
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
    return json.loads(json.dumps(description))


class CorruptEntry(Exception):
    """An entry that must not be run: incomplete, for another key, by another user, or altered."""


class ProgramCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir()

    def load(
        self, description: dict, names: tuple[str, ...], specs: Callable[[], list[ProgramSpec]]
    ) -> tuple[dict[str, Callable], Path | None]:
        """The programs `names` of `description`'s entry (built from `specs()` if need be) and its folder."""
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
        """Delete other builds' entries unused for `UNUSED_DAYS` days and the folders of killed builds."""
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
        start = time.perf_counter()
        workers = build_workers(specs)
        announce(logger, "compiling %d steps for this model shape and mode (%d at a time), once: later starts "
                 "load them from %s", len(specs), workers, self.root)
        builder = f"{os.getpid()}-{socket.gethostname()}-"
        with unwound_by_signals():
            building = Path(tempfile.mkdtemp(prefix=f"{entry.name}{BUILDING}{builder}", dir=self.root))
            try:
                files = build_steps(specs, building, workers)
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
        with unwound_by_signals(), tempfile.TemporaryDirectory(prefix="minigpt-compile-") as folder:
            return _load_packages(Path(folder), build_steps(specs, Path(folder), build_workers(specs)))


def _signed_part(description: dict, files: dict) -> bytes:
    return json.dumps({"description": description, "files": files}, sort_keys=True).encode()


def _load_packages(folder: Path, files: dict[str, str]) -> dict[str, Callable]:
    """The packages of `files` (name -> SHA-256), all checked before any is loaded from the bytes checked."""
    from torch._inductor import aoti_load_package

    packages = {}
    for name, digest in files.items():
        try:
            data = (folder / f"{name}.pt2").read_bytes()
        except OSError:
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
    """Whether the builder a folder's name names (pid and host) is gone: known on its host only."""
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


def _mark_used(entry: Path) -> None:
    try:
        os.utime(entry / MANIFEST)
    except OSError:
        pass


