"""What lets the cache trust an entry (its packages are native code run as this user): a folder owned by this
user and writable by no one else, and a manifest carrying the HMAC of this user's key, 32 random bytes created
0600 in `$XDG_CONFIG_HOME/minigpt/cache.key` (default `~/.config/minigpt`)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
from pathlib import Path

KEY_BYTES = 32


class Untrusted(Exception):
    """A cache folder or key another user could have written or read: the cache is not used."""


def key_file() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "minigpt" / "cache.key"


def check_private(path: Path, info: os.stat_result | None = None) -> None:
    """Raise `Untrusted` unless `path` is owned by this user and writable by no one else."""
    info = info or path.stat()
    if info.st_uid != os.geteuid():
        raise Untrusted(f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})")
    writers = [who for bit, who in ((0o020, "group"), (0o002, "others")) if info.st_mode & bit]
    if writers:
        raise Untrusted(f"{path} is writable by {' and '.join(writers)} (mode {info.st_mode & 0o7777:o})")


def private_folder(path: Path) -> None:
    """Create `path` 0700 if it is missing; raise `Untrusted` unless it is private (`check_private`)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(path)


def user_key() -> bytes:
    """This user's cache key, created on first use; `Untrusted` if others could read or replace it."""
    path = key_file()
    private_folder(path.parent)
    if not path.exists():
        _create_key(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:
        raise Untrusted(f"cannot read the cache key {path}: {err.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        check_private(path, info)
        if info.st_mode & 0o077:
            raise Untrusted(f"the cache key {path} is readable by others (mode {info.st_mode & 0o7777:o})")
        key = file.read()
    if len(key) != KEY_BYTES:
        raise Untrusted(f"the cache key {path} holds {len(key)} bytes, not {KEY_BYTES}: delete it to make a new one")
    return key


def _create_key(path: Path) -> None:
    """A new key written whole, then linked into place: a racing process reads none or all of one."""
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".cache.key.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(secrets.token_bytes(KEY_BYTES))
        try:
            os.link(scratch, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(scratch)


def sign(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def signed_by(key: bytes, body: bytes, signature: object) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign(key, body), signature)
