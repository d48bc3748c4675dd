"""The torch releases minigpt has run on: `compile=True` and `quantize=...` lean on torch internals that
move between releases, so they start only on these."""

from __future__ import annotations

import torch

# pyproject.toml declares the same span
FIRST_TESTED, LAST_TESTED = (2, 13), (2, 14)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version such as "2.13.0+cpu" or "2.15.0a0"."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def pip_requirement() -> str:
    return f"torch>={FIRST_TESTED[0]}.{FIRST_TESTED[1]},<{LAST_TESTED[0]}.{LAST_TESTED[1] + 1}"


def check_torch_for(feature: str) -> None:
    version = str(torch.__version__)
    if not FIRST_TESTED <= release(version) <= LAST_TESTED:
        raise RuntimeError(
            f"{feature} needs {pip_requirement()} (it relies on torch internals that change between releases); "
            f"this is torch {version}"
        )
