"""`verify_weights=True`: weight files checked against the SHA-256 the hub published, which names the blob
each file of huggingface_hub's cache links to (an LFS file's ETag): known with no network."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from pathlib import Path

from minigpt.common.errors import Named, ParamError
from minigpt.model.weights import CheckpointError, weight_files

logger = logging.getLogger("minigpt")


def published_sha256(file: Path) -> str | None:
    """None unless `file` links to `blobs/SHA256` (a small file's ETag is a git hash)."""
    if not file.is_symlink():
        return None
    blob = file.resolve()
    return blob.name if blob.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", blob.name) else None


class UnpublishedWeights(ParamError, CheckpointError):
    pass


def verify_weights(path: Path, published: Callable[[Path], str | None] = published_sha256) -> None:
    files = weight_files(path)
    for file in files:
        expected = published(file)
        if expected is None:
            raise UnpublishedWeights("", "verify_weights", (Named("verify_weights", True), ": no published SHA-256 is "
                                     f"known for {file} (only a hub download has one): run without it"))
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != expected:
            raise CheckpointError(f"{file} is not the file the hub published: its SHA-256 is {digest.hexdigest()}, "
                                  f"the hub's {expected}; delete it and download it again")
    logger.info("verified %d weight file%s against the hub's SHA-256", len(files), "s" * (len(files) > 1))
