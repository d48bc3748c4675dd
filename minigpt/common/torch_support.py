"""The torch releases minigpt has run on: `compile=True` and `quantize=...` lean on torch internals that
move between releases, so they start only on these."""

from __future__ import annotations

import torch

from minigpt.common.errors import Named, ParamError

# pyproject.toml declares the same span
FIRST_TESTED, LAST_TESTED = (2, 13), (2, 14)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version such as "2.13.0+cpu" or "2.15.0a0"."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def pip_requirement() -> str:
    return f"torch>={FIRST_TESTED[0]}.{FIRST_TESTED[1]},<{LAST_TESTED[0]}.{LAST_TESTED[1] + 1}"


class UnsupportedTorch(ParamError, RuntimeError):
    """A setting refused on a torch release it has not run on."""


def check_torch_for(field: str, value: object) -> None:
    """Refuse the setting `field=value` unless this torch is a tested release."""
    version = str(torch.__version__)
    if not FIRST_TESTED <= release(version) <= LAST_TESTED:
        raise UnsupportedTorch("", field, (Named(field, value), f" needs {pip_requirement()} (it relies on torch "
                                           f"internals that change between releases); this is torch {version}"))
