"""Check a wheel against the source tree: it holds every file of minigpt/ and of kernels/ (as minigpt/kernels/), the
licence, and nothing outside minigpt/ but its metadata. Prints each fault on a line and exits 1 if there is one.

    python .ci/wheel_contents.py dist/minigpt-0.1.0-py3-none-any.whl
    python .ci/wheel_contents.py --modules       the modules the wheel must hold, packages too, one a line
"""

import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALLED_AS = {"minigpt": "minigpt", "kernels": "minigpt/kernels"}  # source folder -> its folder in the wheel


def tree_files(root: Path = ROOT) -> dict[str, str]:
    """Each file under the source folders (no bytecode, no hidden file) -> its path in the wheel."""
    files = {}
    for source, installed in INSTALLED_AS.items():
        for file in sorted((root / source).rglob("*")):
            inside = file.relative_to(root / source)
            if file.is_file() and "__pycache__" not in inside.parts and not file.name.startswith("."):
                files[file.relative_to(root).as_posix()] = f"{installed}/{inside.as_posix()}"
    return files


def modules(root: Path = ROOT) -> list[str]:
    """The dotted name of each module of the tree as installed (a package's is its folder's)."""
    return sorted(path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                  for path in tree_files(root).values() if path.endswith(".py"))


def faults(wheel: Path, root: Path = ROOT) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    found = [f"the wheel lacks {installed} ({source})" for source, installed in tree_files(root).items()
             if installed not in names]
    if not any(name.endswith(".dist-info/licenses/LICENSE") for name in names):
        found.append("the wheel lacks the licence (LICENSE in its .dist-info/licenses/)")
    found += [f"the wheel holds {name} outside minigpt/" for name in sorted(names)
              if not name.startswith("minigpt/") and not name.split("/")[0].endswith(".dist-info")]
    return found


if __name__ == "__main__":
    if sys.argv[1:] == ["--modules"]:
        print("\n".join(modules()))
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    problems = faults(Path(sys.argv[1]))
    print("\n".join(problems) or f"{sys.argv[1]}: every file of minigpt/ and kernels/ and the licence are in it")
    sys.exit(1 if problems else 0)
