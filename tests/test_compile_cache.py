"""compile=True's programs on disk (minigpt/compile/cache.py): built once per model shape and mode,
loaded by every later engine, rebuilt (never run) when an entry is altered or written for another
build, and run over the engine's own weights."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
from unittest import mock

import pytest
import torch

from minigpt import LLM, SamplingParams
from minigpt.compile import build as compile_build
from minigpt.compile import cache as compile_cache
from minigpt.compile.cache import MANIFEST, CorruptEntry, ProgramCache, ProgramSpec, default_cache_dir, entry_key
from minigpt.compile.steps import CompiledSteps
from minigpt.compile.trust import sign, user_key

from conftest import random_prompts

PROMPTS = random_prompts([3, 17, 40], seed=5)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def built_entry(tiny_checkpoint):
    """(the tiny model's entry in the session's cache, its eager tokens), the entry built if need be."""
    with LLM(str(tiny_checkpoint)) as llm:
        want = tokens(llm)
    with LLM(str(tiny_checkpoint), compile=True) as llm:
        assert tokens(llm) == want
        return llm.engine.runner.forward_path.cache_entry, want


@pytest.mark.slow
def test_a_second_engine_loads_the_entry_without_compiling(tiny_checkpoint, built_entry):
    entry, want = built_entry
    with mock.patch.object(ProgramCache, "_build", side_effect=AssertionError("compiled again")):
        with LLM(str(tiny_checkpoint), compile=True) as llm:
            assert llm.engine.runner.forward_path.cache_entry == entry
            assert tokens(llm) == want
            assert [llm.generate([p], PARAMS)[0].token_ids for p in PROMPTS] == want


@pytest.mark.slow
def test_an_altered_entry_is_rebuilt_never_run(tiny_checkpoint, built_entry, tmp_path, caplog):
    entry, want = built_entry
    copy = tmp_path / entry.name
    shutil.copytree(entry, copy)
    layer = copy / "layer.pt2"
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    build = ProgramCache._build
    with mock.patch.object(ProgramCache, "_build", autospec=True, side_effect=build) as rebuilt:
        with caplog.at_level(logging.WARNING, logger="minigpt"):
            with LLM(str(tiny_checkpoint), compile=True, compile_cache_dir=str(tmp_path)) as llm:
                assert tokens(llm) == want
    assert rebuilt.call_count == 1
    assert "layer.pt2 is missing or altered" in caplog.text and "rebuilding" in caplog.text
    manifest = json.loads((copy / MANIFEST).read_text())
    assert manifest["description"] == json.loads((entry / MANIFEST).read_text())["description"]
    with mock.patch.object(ProgramCache, "_build", side_effect=AssertionError("compiled again")):
        with LLM(str(tiny_checkpoint), compile=True, compile_cache_dir=str(tmp_path)) as llm:
            assert tokens(llm) == want  # the rebuilt entry serves


def signed(manifest: dict, key: bytes) -> str:
    """`manifest` with its signature made with `key`, as a build writes it."""
    body = compile_cache._signed_part(manifest["description"], manifest["files"])
    return json.dumps({**manifest, "hmac": sign(key, body)})


@pytest.mark.slow
@pytest.mark.parametrize("damage", [
    "no manifest", "manifest of another build", "truncated manifest", "no package", "hash rewritten",
    "signed with another key", "incomplete manifest", "entry writable by others",
])
def test_every_kind_of_damage_is_detected_before_anything_loads(built_entry, tmp_path, damage):
    entry, _ = built_entry
    copy = tmp_path / entry.name
    shutil.copytree(entry, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    if damage == "no manifest":
        (copy / MANIFEST).unlink()
    elif damage == "manifest of another build":
        manifest["description"]["torch"] = "0.0.0"
        (copy / MANIFEST).write_text(signed(manifest, user_key()))
    elif damage == "truncated manifest":
        (copy / MANIFEST).write_text((entry / MANIFEST).read_text()[:100])
    elif damage == "no package":
        (copy / "head.pt2").unlink()
    elif damage == "hash rewritten":  # a package replaced and its hash with it: the signature no longer holds
        shutil.copyfile(copy / "head_alone.pt2", copy / "layer.pt2")
        manifest["files"]["layer"] = manifest["files"]["head_alone"]
        (copy / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "signed with another key":  # an entry copied from another user's cache
        (copy / MANIFEST).write_text(signed(manifest, b"k" * 32))
    elif damage == "incomplete manifest":
        del manifest["files"]["head"]
        (copy / MANIFEST).write_text(signed(manifest, user_key()))
    else:
        copy.chmod(0o777)
    description = json.loads((entry / MANIFEST).read_text())["description"]
    with mock.patch("torch._inductor.aoti_load_package", side_effect=AssertionError("loaded")):
        with pytest.raises(CorruptEntry):
            ProgramCache(tmp_path)._load_entry(copy, description, CompiledSteps.PROGRAMS, user_key())


@pytest.mark.slow
def test_the_programs_run_the_engines_own_weights(tiny_checkpoint, built_entry):
    """No program holds a copy: a weight changed in place after the start changes the compiled
    engine's tokens exactly as the eager engine's; the weights go with the engine."""
    _, want = built_entry
    engines = [LLM(str(tiny_checkpoint)), LLM(str(tiny_checkpoint), compile=True)]
    try:
        changed = []
        for llm in engines:
            model = llm.engine.runner.model
            with torch.no_grad():
                model.h[0].ln_1.weight.mul_(-3.0)  # read by the halves' and the decode program
            changed.append(tokens(llm))
        assert changed[0] == changed[1] != want
    finally:
        for llm in engines:
            llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_steps_built_in_turn_or_side_by_side_serve_alike(tiny_checkpoint, built_entry, tmp_path, workers):
    """A first start builds its steps in processes of their own, as many at once as it has cores (one
    on a one-core machine, in this process): either way the entry gives the eager tokens."""
    entry, want = built_entry
    with mock.patch.object(compile_cache, "build_workers", return_value=workers):
        with LLM(str(tiny_checkpoint), compile=True, compile_cache_dir=str(tmp_path)) as llm:
            assert llm.engine.runner.forward_path.cache_entry.name == entry.name
            assert tokens(llm) == want
    assert sorted(path.name for path in (tmp_path / entry.name).iterdir()) == sorted(
        path.name for path in entry.iterdir())  # packages and manifest only: no spec or log left behind


def test_a_worker_unpickles_only_what_a_step_is_made_of(tmp_path):
    """The worker loads its spec with weights_only=True, allowing minigpt's and torch's modules only."""
    from minigpt.compile.worker import load_spec

    spec = ProgramSpec("linear", torch.nn.Linear(4, 4), (torch.zeros(3, 4),), None)
    torch.save(spec, tmp_path / "ok.spec")
    loaded = load_spec(str(tmp_path / "ok.spec"))
    assert loaded.name == "linear" and torch.equal(loaded.module.weight, spec.module.weight)
    torch.save(ProgramSpec("evil", shutil.rmtree, (str(tmp_path),), None), tmp_path / "evil.spec")
    with pytest.raises(ValueError, match="shutil.rmtree"):
        load_spec(str(tmp_path / "evil.spec"))
    assert tmp_path.exists()


def test_a_step_that_fails_to_build_in_its_process_says_why(tmp_path):
    spec = ProgramSpec("broken", torch.nn.Linear(4, 4), (torch.zeros(3, 5),), None)  # 5 inputs into 4
    with pytest.raises(RuntimeError, match=r"compiling step broken failed: .*\S"):
        compile_build._build_side_by_side([spec], tmp_path, 2)
    assert not list(tmp_path.glob("*.pt2"))


def test_the_key_names_everything_a_program_depends_on():
    description = {"torch": "2.13.0", "config": [["n_layer", 2]], "pool": ["torch.float16", 2, 2, 16, 4, 16]}
    assert entry_key(description) == entry_key(json.loads(json.dumps(description)))
    for field, other in (("torch", "2.14.0"), ("config", [["n_layer", 3]]), ("pool", ["torch.float32", 2])):
        assert entry_key({**description, field: other}) != entry_key(description)


def test_the_source_digest_follows_the_kernels_c_sources_in_a_tree_and_a_wheel(monkeypatch, tmp_path):
    """A program calls a kernel's op by its schema: a changed .cpp makes another key, and the digest does not
    depend on where the kernels lie (beside minigpt/ in a tree, minigpt/kernels/ in a wheel)."""
    from minigpt import kernels

    root = compile_cache.Path(compile_cache.__file__).resolve().parents[1]
    tree, wheel = tmp_path / "tree", tmp_path / "wheel"
    for path in root.rglob("*.py"):
        for top in (tree / "minigpt", wheel / "minigpt"):
            (top / path.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, top / path.relative_to(root))
    source_kernels = compile_cache.Path(kernels.__file__).resolve().parent
    shutil.rmtree(wheel / "minigpt" / "kernels", ignore_errors=True)
    for folder in (tree / "kernels", wheel / "minigpt" / "kernels"):
        shutil.copytree(source_kernels, folder, ignore=shutil.ignore_patterns("__pycache__"))

    def digest(top, kernel_folder):
        monkeypatch.setattr(compile_cache, "__file__", str(top / "minigpt" / "compile" / "cache.py"))
        monkeypatch.setattr(kernels, "__file__", str(kernel_folder / "__init__.py"))
        return compile_cache.source_digest()

    in_tree, in_wheel = digest(tree, tree / "kernels"), digest(wheel, wheel / "minigpt" / "kernels")
    assert in_tree == in_wheel
    source = tree / "kernels" / "pool_attention_avx2.cpp"
    source.write_text(source.read_text() + "\n// changed\n")
    assert digest(tree, tree / "kernels") != in_tree


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIGPT_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("MINIGPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "minigpt" / "compiled"
    assert ProgramCache(str(tmp_path / "given")).root == tmp_path / "given"


@pytest.mark.slow
def test_precompile_builds_the_entry_a_later_engine_loads(tiny_checkpoint, compile_cache_dir, capsys):
    from minigpt.precompile import main

    assert main(["--model", str(tiny_checkpoint), "--block-size", "8"]) == 0
    entry = capsys.readouterr().out.strip()
    assert (compile_cache_dir / entry.rsplit("/", 1)[-1] / MANIFEST).is_file()
    with mock.patch.object(ProgramCache, "_build", side_effect=AssertionError("compiled again")):
        with LLM(str(tiny_checkpoint), compile=True, block_size=8) as llm:
            assert str(llm.engine.runner.forward_path.cache_entry) == entry


@pytest.mark.slow
def test_precompile_fails_where_it_cannot_store(tiny_checkpoint, built_entry, tmp_path, capsys):
    """A cache folder others can write is not used: the steps are built apart, and precompile says
    that nothing was stored."""
    from minigpt.precompile import main

    entry, _ = built_entry
    files = json.loads((entry / MANIFEST).read_text())["files"]
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with mock.patch.object(ProgramCache, "_build_privately",
                           side_effect=lambda specs: compile_cache._load_packages(entry, files)) as apart:
        assert main(["--model", str(tiny_checkpoint), "--compile-cache-dir", str(shared)]) == 1
    assert apart.call_count == 1 and not list(shared.iterdir())
    assert "built but not stored" in capsys.readouterr().err


def test_precompile_refuses_a_bad_flag_in_one_line(tiny_checkpoint, capsys):
    from minigpt.precompile import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tiny_checkpoint), "--block-size", "many"])
    assert exit_.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


BUILD = {"format": 1, "minigpt": "abc", "torch": "2.13.0", "torch_git": "f00"}


def _folder(root, name, age_days, built_by=None):
    """A folder `age_days` old: with a manifest written by `built_by` (a description), else a bare one."""
    path = root / name
    path.mkdir()
    stamped = path if built_by is None else path / MANIFEST
    if built_by is not None:
        stamped.write_text(json.dumps({"description": built_by, "files": {}}))
    (path / "layer.pt2").write_bytes(b"0" * 1000)
    old = time.time() - age_days * 86400
    os.utime(stamped, (old, old))
    return path


def building(key: str, pid: int, host: str = socket.gethostname()) -> str:
    """The name of a folder in which the process `pid` on `host` builds the entry `key`."""
    return f"{key * 32}{compile_cache.BUILDING}{pid}-{host}-x1_y"


def test_a_start_deletes_long_unused_entries_of_other_builds_and_folders_of_killed_builds(tmp_path, caplog):
    days, other = compile_cache.UNUSED_DAYS, {**BUILD, "minigpt": "older"}
    ended = subprocess.Popen(["true"])
    ended.wait()
    kept = [
        _folder(tmp_path, "a" * 32, days + 5, BUILD),  # this build's: it may serve from a read-only cache
        _folder(tmp_path, "b" * 32, days - 1, other),  # another build's, used lately
        _folder(tmp_path, "mine", days + 5, other),  # not named as an entry: not the cache's
        _folder(tmp_path, "c" * 32 + compile_cache.BUILDING + "x", 0.5),  # a build under way
        _folder(tmp_path, building("c", os.getpid()), 0.5),  # ... by a process that is running
        _folder(tmp_path, building("c", ended.pid, "another-host"), 0.5),  # ... where its pid says nothing
        _folder(tmp_path, "shared" + compile_cache.BUILDING + "y", 2),
    ]
    deleted = [_folder(tmp_path, "d" * 32, days + 1, other),
               _folder(tmp_path, "e" * 32, days + 1, {**BUILD, "torch": "2.12.0"}),
               _folder(tmp_path, "f" * 32 + compile_cache.BUILDING + "z", 2),
               _folder(tmp_path, building("f", ended.pid), 0)]  # its process is gone
    (tmp_path / "notes.txt").write_text("not a folder")
    with caplog.at_level(logging.INFO, logger="minigpt"):
        ProgramCache(tmp_path).prune({**BUILD, "config": "any"})
    assert all(path.exists() for path in kept) and not any(path.exists() for path in deleted)
    assert "deleted 4 compile cache folders" in caplog.text and (tmp_path / "notes.txt").exists()
    ProgramCache(tmp_path / "never made").prune(BUILD)


def test_a_load_marks_its_entry_used_and_every_start_prunes(tmp_path):
    entry = _folder(tmp_path, entry_key(BUILD), compile_cache.UNUSED_DAYS + 1, BUILD)
    with mock.patch.object(ProgramCache, "_load_entry", return_value={}):
        ProgramCache(tmp_path).load(BUILD, (), specs=lambda: pytest.fail("built"))
    ProgramCache(tmp_path).prune({**BUILD, "minigpt": "newer"})  # to a newer build this entry is another's:
    assert entry.exists()  # kept only because the load marked it used
    stale = _folder(tmp_path, "0" * 32, compile_cache.UNUSED_DAYS + 1, {**BUILD, "minigpt": "older"})
    built = {**BUILD, "config": "other"}
    with mock.patch.object(ProgramCache, "_build"), mock.patch.object(ProgramCache, "_load_entry", return_value={}):
        ProgramCache(tmp_path).load(built, (), specs=list)
    assert not stale.exists() and entry.exists()
