"""The packages the wheel holds, found rather than listed: every package under minigpt/, and kernels/ (with any
package under it) as minigpt.kernels, so it never clashes with PyPI's `kernels` package. In the source tree
minigpt/kernels is a link to kernels/, so the tree imports as the wheel does (`python -m minigpt.generate` run
from this folder finds this folder's minigpt first, installed or not); the wheel takes kernels/ itself. The rest
of the build's settings are in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["minigpt", "minigpt.*"], exclude=["minigpt.kernels", "minigpt.kernels.*"])
    + ["minigpt." + name for name in find_packages(include=["kernels", "kernels.*"])],
    package_dir={"minigpt.kernels": "kernels"},
    package_data={
        "minigpt.kernels": ["*.cpp"],  # C++ sources, built where they run (minigpt/compile/native.py)
        "minigpt": ["demo_model/*"],  # the demo model, its tokenizer, card and held-out text (minigpt/demo.py)
    },
)
