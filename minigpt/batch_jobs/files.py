"""The job's files: input lines read lazily, the input checked for repeated custom_ids before anything runs,
an output file resumed (what it holds already is skipped; a last line torn by a kill is cut off) and
appended a whole line at a time, flushed as each result completes. `-` is stdin or stdout; an input that is not a
regular file (a pipe, `<(zcat ...)`) is read once, as stdin is."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from minigpt.batch_jobs.answer import custom_id_of, key_of_output_id, line_key

BOM = b"\xef\xbb\xbf"


def open_input(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    try:
        return open(path, "rb")  # noqa: SIM115  (closed by the job)
    except OSError as err:
        raise ValueError(f"cannot read -i {path}: {err.strerror}") from None


def read_once(path: str) -> bool:
    """Whether the input cannot be read twice (stdin, a pipe, a device): then it is not scanned before the job."""
    if path == "-":
        return True
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False  # open_input says why


def check_writable(path: Path, flag: str) -> None:
    """Refuses a file the job writes only at its end, before the job runs."""
    where = path if path.exists() else path.parent
    problem = ("is a directory" if path.is_dir() else "no such directory" if not path.parent.is_dir()
               else None if os.access(where, os.W_OK) else "permission denied")
    if problem is not None:
        raise ValueError(f"cannot write {flag} {path}: {problem}")


def numbered_lines(stream: BinaryIO) -> Iterator[tuple[int, str | UnicodeDecodeError]]:
    """(line number, text or its UnicodeDecodeError) of each non-blank line, lazily."""
    for number, raw in enumerate(stream, 1):
        if number == 1:
            raw = raw.removeprefix(BOM)
        if not raw.strip():
            continue
        try:
            yield number, raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
        except UnicodeDecodeError as err:
            yield number, err


def scan_input(path: str, done: set[int]) -> int:
    seen: set[int] = set()
    todo = 0
    with open_input(path) as stream:
        for number, text in numbered_lines(stream):
            key = line_key(custom_id_of(text), number)
            if key in seen:
                raise ValueError(_repeated(path, number, text))
            seen.add(key)
            todo += key not in done
    return todo


def _repeated(path: str, number: int, text: str | UnicodeDecodeError) -> str:
    custom_id = custom_id_of(text)
    with open_input(path) as stream:
        first = next(n for n, t in numbered_lines(stream) if custom_id_of(t) == custom_id)
    return f"line {number} of {path} repeats custom_id {custom_id!r} of line {first}: custom_ids must be unique"


def resume_output(path: str) -> set[int]:
    """The keys of the results in `path`; a last line torn by a kill is cut off to be redone."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe or a device: nothing to resume
            return set()
        stream = open(path, "r+b")  # noqa: SIM115
    except FileNotFoundError:
        return set()
    except OSError as err:
        raise ValueError(f"cannot open -o {path}: {err.strerror}") from None
    done: set[int] = set()
    with stream:
        end = 0  # the byte after the last whole line
        for number, raw in enumerate(stream, 1):
            if not raw.endswith(b"\n"):
                break  # torn: cut below
            end += len(raw)
            if not raw.strip():
                continue
            try:
                key = key_of_output_id(json.loads(raw).get("id"))
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                key = None
            if key is None:
                raise ValueError(f"-o {path} line {number} is not a result line of a batch job: give a new "
                                 "output file, or the one an earlier run of this job wrote")
            done.add(key)
        stream.truncate(end)
    return done


class ResultWriter:

    def __init__(self, path: str) -> None:
        self.path, self.failed, self._remove = path, False, False
        self.created = path != "-" and not os.path.lexists(path)
        try:
            self.stream = sys.stdout.buffer if path == "-" else open(path, "ab")  # noqa: SIM115
        except OSError as err:
            raise ValueError(f"cannot write -o {path}: {err.strerror}") from None
        if path != "-":
            try:  # one job at a time on an output: two would each write what the other does
                fcntl.flock(self.stream.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.stream.close()
                raise ValueError(f"another job is writing -o {path}") from None
            except OSError:  # a file system without locks
                pass

    def abandon(self) -> None:
        """The job is refused before it wrote anything: `close` removes the file if this job made it."""
        self._remove = self.created

    def write(self, record: dict) -> None:
        try:
            self.stream.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
            self.stream.flush()
        except OSError:
            self.failed = True  # what did not get out stays unwritten: a rerun redoes it
            raise

    def flush(self) -> None:
        if not self.failed:
            self.stream.flush()

    def close(self) -> None:
        if self.stream is sys.stdout.buffer:
            self.flush()
        elif self.failed:
            self.stream.raw.close()  # without flushing the buffer that could not be written
        else:
            self.stream.flush()
            if stat.S_ISREG(os.fstat(self.stream.fileno()).st_mode):  # on disk, not only in the page cache
                os.fsync(self.stream.fileno())
            self.stream.close()
        if self._remove:
            os.unlink(self.path)
