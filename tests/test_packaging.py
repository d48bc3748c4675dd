"""The wheel holds every package folder of the tree (kernels/ as minigpt.kernels) and the licence, and
.ci/wheel_contents.py, which CI runs on the wheel it installs, says so and names what a wheel lacks."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / ".ci" / "wheel_contents.py"
BUILD_READS = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "minigpt", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built offline (the environment's setuptools) from a copy of what the build reads: a build folder
    left in the tree by an earlier build would lend the wheel its files."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in BUILD_READS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    command = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-q", "--outdir", str(dist), str(source)]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    return next(dist.glob("minigpt-*.whl"))


def check(wheel: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), str(wheel)], capture_output=True, text=True, check=False)


def test_the_wheel_holds_every_package_folder_and_the_licence(wheel):
    packages = {init.parent for folder in ("minigpt", "kernels") for init in (ROOT / folder).rglob("__init__.py")}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for package in packages:
        inside = package.relative_to(ROOT).as_posix()
        installed = "minigpt/" + inside if inside.startswith("kernels") else inside
        assert f"{installed}/__init__.py" in names, f"the wheel lacks the package {inside}/"
    assert not any(name.startswith("kernels/") for name in names), "kernels/ must install as minigpt/kernels/"
    result = check(wheel)
    assert result.returncode == 0, result.stdout


def test_the_check_names_what_a_wheel_lacks(wheel, tmp_path):
    lacking = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as full, zipfile.ZipFile(lacking, "w") as partial:
        for item in full.infolist():
            if not item.filename.startswith("minigpt/speculative/") and not item.filename.endswith("/LICENSE"):
                partial.writestr(item, full.read(item))
            if item.filename == "minigpt/kernels/kv_store.py":
                partial.writestr("kernels/kv_store.py", full.read(item))
    result = check(lacking)
    assert result.returncode == 1
    assert "the wheel lacks minigpt/speculative/__init__.py (minigpt/speculative/__init__.py)" in result.stdout
    assert "the wheel lacks the licence" in result.stdout
    assert "the wheel holds kernels/kv_store.py outside minigpt/" in result.stdout


def test_the_modules_ci_imports_are_the_trees(wheel):
    listed = subprocess.run([sys.executable, str(CHECK), "--modules"], capture_output=True, text=True, check=True)
    modules = set(listed.stdout.split())
    assert {"minigpt", "minigpt.kernels", "minigpt.kernels.paged_attention", "minigpt.engine.speculative_config",
            "minigpt.tensor_parallel", "minigpt.cli"} <= modules
    with zipfile.ZipFile(wheel) as archive:
        installed = {name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                     for name in archive.namelist() if name.endswith(".py")}
    assert modules == installed


def test_minigpt_imports_quietly_without_numpy():
    """numpy is no dependency (the design card's four packages); torch's warning at import where it is absent
    would greet every command of a plain install."""
    script = "import sys; sys.modules['numpy'] = None; import minigpt"
    run = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script], capture_output=True, text=True,
                         check=False, cwd=ROOT)
    assert run.returncode == 0 and run.stderr == "", run.stderr
