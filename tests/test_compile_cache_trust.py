"""The compile cache trusts only what its user wrote (minigpt/compile/trust.py, minigpt/compile/cache.py):
a private folder, entries signed with the user's key, an incomplete manifest a rebuild; and a build
interrupted by a signal leaves no process and, after the next start, no folder behind."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path
from unittest import mock

import pytest

from minigpt import LLM, SamplingParams
from minigpt.compile import build as compile_build
from minigpt.compile import cache as compile_cache
from minigpt.compile.cache import BUILDING, MANIFEST, ProgramCache, entry_key
from minigpt.compile.trust import Untrusted, key_file, sign, user_key

from conftest import random_prompts

BUILD = {"format": 2, "minigpt": "abc", "torch": "2.13.0", "torch_git": "f00"}
NAMES = ("layer", "head")
PROMPTS = random_prompts([3, 17], seed=7)
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
NOBODY = 65534


def write_entry(root: Path, description: dict, names=NAMES, key: bytes | None = None) -> Path:
    """An entry of fake packages for `description`, its manifest signed with `key` (the user's by default)."""
    entry = root / entry_key(description)
    entry.mkdir(mode=0o700)
    files = {}
    for name in names:
        (entry / f"{name}.pt2").write_bytes(name.encode())
        files[name] = compile_build.sha256_file(entry / f"{name}.pt2")
    body = compile_cache._signed_part(description, files)
    manifest = {"description": description, "files": files, "hmac": sign(key or user_key(), body)}
    (entry / MANIFEST).write_text(json.dumps(manifest))
    return entry


def contents(root: Path) -> list[tuple[str, int, int]]:
    """Every path under `root` with its size and modification time."""
    return sorted((str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in root.rglob("*"))


def test_the_folder_is_made_private_and_the_key_readable_by_its_user_alone(tmp_path):
    root = tmp_path / "made" / "here"
    with mock.patch.object(ProgramCache, "_build"), mock.patch.object(ProgramCache, "_load_entry", return_value={}):
        assert ProgramCache(root).load(BUILD, NAMES, specs=list) == ({}, root / entry_key(BUILD))
    assert root.stat().st_mode & 0o777 == 0o700
    key = key_file()
    assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    assert len(user_key()) == 32 and user_key() == key.read_bytes()


@pytest.fixture
def damaged_key():
    """The user's key, for a test to damage: put back as it was after, so the entries signed with it (the
    session's) stay valid whatever runs next."""
    original, key = user_key(), key_file()
    yield key
    for path in (key, key.with_name("elsewhere")):
        if path.is_symlink() or path.exists():
            path.unlink()
    key.write_bytes(original)
    key.chmod(0o600)


@pytest.mark.parametrize("damage", ["readable by others", "writable by group", "short", "a link"])
def test_a_key_others_could_read_or_write_is_refused(damage, damaged_key):
    key = damaged_key
    if damage == "readable by others":
        key.chmod(0o644)
    elif damage == "writable by group":
        key.chmod(0o620)
    elif damage == "short":
        key.write_bytes(b"short")
    else:
        key.rename(key.with_name("elsewhere"))
        key.symlink_to(key.with_name("elsewhere"))
    with pytest.raises(Untrusted):
        user_key()


def _left_alone(root: Path, caplog, reason: str) -> None:
    """A cache at `root` is neither read nor written: the steps are built apart, with a one-line warning."""
    write_entry(root, BUILD, key=b"k" * 32)
    dead = root / f"{'0' * 32}{BUILDING}1-host-x"
    dead.mkdir()
    before = contents(root)
    with (mock.patch.object(ProgramCache, "_build_privately", return_value={"built": "apart"}) as apart,
          mock.patch.object(ProgramCache, "_load_entry", side_effect=AssertionError("loaded")),
          caplog.at_level(logging.WARNING, logger="minigpt")):
        assert ProgramCache(root).load(BUILD, NAMES, specs=list) == ({"built": "apart"}, None)
    assert apart.call_count == 1 and contents(root) == before
    (warning,) = [record.getMessage() for record in caplog.records]
    assert reason in warning and "compile cache not used" in warning and "\n" not in warning


@pytest.mark.parametrize("mode, writers", [
    (0o777, "group and others"), (0o1777, "group and others"), (0o770, "group"), (0o703, "others"),
])
def test_a_folder_writable_by_others_is_left_alone(tmp_path, caplog, mode, writers):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    _left_alone(root, caplog, f"{root} is writable by {writers} (mode {mode:o})")


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another user: root only")
def test_a_folder_of_another_user_is_left_alone(tmp_path, caplog):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    _left_alone(root, caplog, f"{root} is owned by uid {NOBODY}, not by this user")


def test_a_key_that_cannot_be_trusted_leaves_the_cache_alone(tmp_path, caplog, damaged_key):
    damaged_key.chmod(0o640)
    _left_alone(tmp_path, caplog, f"the cache key {damaged_key} is readable by others (mode 640)")


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another user: root only")
def test_an_entry_of_another_user_is_never_loaded(tmp_path, caplog):
    entry = write_entry(tmp_path, BUILD)
    os.chown(entry, NOBODY, NOBODY)
    with pytest.raises(compile_cache.CorruptEntry, match=f"owned by uid {NOBODY}"):
        with mock.patch("torch._inductor.aoti_load_package", side_effect=AssertionError("loaded")):
            ProgramCache(tmp_path)._load_entry(entry, BUILD, NAMES, user_key())


@pytest.mark.parametrize("manifest", ["incomplete", "with a step too many"])
def test_a_manifest_that_lists_other_steps_is_a_rebuild_not_a_crash(tmp_path, caplog, manifest):
    """A manifest signed and consistent, but not of the steps asked for, is rebuilt: never a KeyError."""
    write_entry(tmp_path, BUILD, NAMES[:1] if manifest == "incomplete" else (*NAMES, "extra"))

    def rebuild(self, entry, description, specs, key):
        write_entry(tmp_path, description)

    with (mock.patch.object(ProgramCache, "_build", autospec=True, side_effect=rebuild) as rebuilt,
          mock.patch.object(compile_cache, "_load_packages", side_effect=lambda folder, files: dict(files)),
          caplog.at_level(logging.WARNING, logger="minigpt")):
        programs, entry = ProgramCache(tmp_path).load(BUILD, NAMES, specs=list)
    assert rebuilt.call_count == 1 and sorted(programs) == sorted(NAMES)
    assert "its manifest lists" in caplog.text and "rebuilding it" in caplog.text


# --- with real packages


def tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def eager_tokens(tiny_checkpoint):
    with LLM(str(tiny_checkpoint)) as llm:
        return tokens(llm)


@pytest.fixture(scope="module")
def session_entry(tiny_checkpoint, eager_tokens):
    """The tiny model's entry in the session's cache, built if need be."""
    with LLM(str(tiny_checkpoint), compile=True) as llm:
        assert tokens(llm) == eager_tokens
        return llm.engine.runner.forward_path.cache_entry


def planted_copy(entry: Path, root: Path, marker: Path) -> Path:
    """A copy of `entry` in `root` whose layer package holds a shared object with a constructor that
    writes `marker`, and whose manifest holds the planted package's SHA-256 (but no new signature)."""
    source = root.parent / "planted.c"
    source.write_text(textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void) {{
            FILE *f = fopen("{marker}", "w");
            if (f) {{ fputs("ran", f); fclose(f); }}
        }}
    """))
    library = root.parent / "planted.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    copy = shutil.copytree(entry, root / entry.name)
    package = copy / "layer.pt2"
    with zipfile.ZipFile(entry / "layer.pt2") as original, zipfile.ZipFile(package, "w") as planted:
        libraries = [item for item in original.infolist() if item.filename.endswith(".so")]
        assert libraries
        for item in original.infolist():
            planted.writestr(item, library.read_bytes() if item in libraries else original.read(item))
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"]["layer"] = compile_build.sha256_file(package)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def assert_runs_when_loaded(package: Path, marker: Path) -> None:
    """The planted package, loaded by torch in a process of its own, runs its constructor: the tests
    that it never runs here are not vacuous."""
    load = "import sys; from torch._inductor import aoti_load_package; aoti_load_package(sys.argv[1])"
    subprocess.run([sys.executable, "-c", load, str(package)], capture_output=True)
    assert marker.read_text() == "ran"


@pytest.mark.slow
def test_a_planted_entry_never_runs_and_is_rebuilt(tiny_checkpoint, session_entry, eager_tokens, tmp_path, caplog):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    marker = tmp_path / "planted-ran"
    planted_copy(session_entry, root, marker)

    def rebuild(self, entry, description, specs, key):
        shutil.copytree(session_entry, entry)

    with (mock.patch.object(ProgramCache, "_build", autospec=True, side_effect=rebuild) as rebuilt,
          caplog.at_level(logging.WARNING, logger="minigpt")):
        with LLM(str(tiny_checkpoint), compile=True, compile_cache_dir=str(root)) as llm:
            assert tokens(llm) == eager_tokens
    assert rebuilt.call_count == 1 and not marker.exists()
    assert "its manifest is not signed with this user's cache key" in caplog.text
    (tmp_path / "again").mkdir()
    assert_runs_when_loaded(planted_copy(session_entry, tmp_path / "again", marker) / "layer.pt2", marker)


@pytest.mark.slow
def test_a_planted_entry_in_a_folder_others_can_write_never_runs(tiny_checkpoint, session_entry, eager_tokens,
                                                                  tmp_path, caplog):
    """The attack as reported: a world-writable `MINIGPT_CACHE_DIR` and an entry planted there, even one
    signed right: the folder is left alone and the steps built apart, in a folder deleted after."""
    root = tmp_path / "shared"
    root.mkdir()
    marker = tmp_path / "planted-ran"
    planted = planted_copy(session_entry, root, marker)
    manifest = json.loads((planted / MANIFEST).read_text())
    manifest["hmac"] = sign(user_key(), compile_cache._signed_part(manifest["description"], manifest["files"]))
    (planted / MANIFEST).write_text(json.dumps(manifest))
    root.chmod(0o777)
    before = contents(root)
    with (mock.patch.object(ProgramCache, "_build", side_effect=AssertionError("stored")),
          caplog.at_level(logging.WARNING, logger="minigpt")):
        with LLM(str(tiny_checkpoint), compile=True, compile_cache_dir=str(root)) as llm:
            assert llm.engine.runner.forward_path.cache_entry is None
            assert tokens(llm) == eager_tokens
    assert not marker.exists() and contents(root) == before
    assert f"{root} is writable by group and others (mode 777)" in caplog.text
    assert_runs_when_loaded(planted / "layer.pt2", marker)


def workers_of(parent: int) -> list[int]:
    """The pids of `parent`'s compile workers."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"minigpt.compile.worker" in command:
            found.append(int(stat.parent.name))
    return found


def alive_in_groups(groups: set[int]) -> list[int]:
    """The processes, not yet ended, of the process groups `groups`."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) in groups and state not in "ZX":
            alive.append(int(stat.parent.name))
    return alive


def signals_at_their_defaults() -> None:
    """Undo what a launcher set (nohup ignores SIGHUP, a shell's background job SIGINT): the engine leaves an
    ignored signal ignored, and this test is about the signals that end it."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def wait_for(condition, what: str, limit: float = 300):
    """Poll `condition()` until it is truthy (its value), failing after `limit` seconds."""
    end = time.monotonic() + limit
    while not (value := condition()):
        if time.monotonic() > end:
            pytest.fail(f"never {what}")
        time.sleep(0.2)
    return value


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP", "SIGKILL"])
def test_a_signal_during_a_first_build_leaves_no_process_and_no_folder(tiny_checkpoint, tmp_path, name):
    """The engine's process ended while its steps are built side by side: its workers and their compilers
    end with it; a folder left by a process killed outright is deleted at the next start."""
    sig = getattr(signal, name)
    root = tmp_path / "cache"
    start = (f"from minigpt import LLM; from minigpt.compile import cache as c; c.build_workers = lambda specs: 2; "
             f"LLM({str(tiny_checkpoint)!r}, compile=True, compile_cache_dir={str(root)!r})")
    engine = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              preexec_fn=signals_at_their_defaults)
    try:
        groups = set(wait_for(lambda: workers_of(engine.pid), "saw a compile worker"))
        engine.send_signal(sig)
        ended = engine.wait()  # SIGINT: a KeyboardInterrupt, which may end the process with 1
        assert ended == -sig or (sig == signal.SIGINT and ended == 1), engine.stderr.read().decode()[-2000:]
        wait_for(lambda: not alive_in_groups(groups), "saw the workers and their compilers end")
    finally:
        engine.kill()
        engine.wait()
    left = [path.name for path in root.iterdir()]
    assert len(left) == (1 if sig == signal.SIGKILL else 0) and all(BUILDING in name for name in left)
    ProgramCache(root).prune({})  # what the next start does first
    assert not list(root.iterdir())


def test_a_signal_the_launcher_ignored_stays_ignored_through_a_build():
    """Under nohup a SIGHUP is ignored: the build takes only the signals left at their defaults."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with compile_build.unwound_by_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before[0])
        signal.signal(signal.SIGTERM, before[1])
