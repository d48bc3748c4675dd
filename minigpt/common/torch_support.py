"""The torch releases minigpt has been run on, and the check the engine makes at start.

The eager float paths use public torch APIs only. `compile=True` and `quantize=...` lean on torch
internals (inductor's code cache, frozen graphs, private int8 ops) that move between releases, so
they start only on a release the whole suite has passed on.
"""

from __future__ import annotations

import torch

# (major, minor) releases the suite has passed on, in order; pyproject.toml declares the same span
FIRST_TESTED, LAST_TESTED = (2, 13), (2, 14)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version such as "2.13.0+cpu" or "2.15.0a0"."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def pip_requirement() -> str:
    """The torch requirement of pyproject.toml, e.g. "torch>=2.13,<2.15"."""
    return f"torch>={FIRST_TESTED[0]}.{FIRST_TESTED[1]},<{LAST_TESTED[0]}.{LAST_TESTED[1] + 1}"


def check_torch_for(feature: str) -> None:
    """Refuse `feature` on a torch release it has not been run on, naming the releases it needs."""
    version = str(torch.__version__)
    if not FIRST_TESTED <= release(version) <= LAST_TESTED:
        raise RuntimeError(
            f"{feature} needs {pip_requirement()} (it relies on torch internals that change between releases); "
            f"this is torch {version}"
        )
