"""The files a batch job writes: OUTPUT, resumable and append-only, and ERRORS (no jax).

OUTPUT holds one JSON object a line, each with the `id` of its input row. `OutputJournal`
appends each batch of finished rows in one write, then flushes and fsyncs it, and writes a
row only if its id is not in the file yet: a killed job (even `kill -9`) leaves whole rows
and at most one torn last line, and never a row twice. `OutputJournal.open` locks OUTPUT
(`flock`: a second job on the same file is refused while the first runs, and a killed job's
lock goes with it), reads the ids already written (`done`), cuts a torn last line (whatever
follows the last newline) and appends after it. A complete line that is not such a row means
the file is not a batch job's output: it is refused and left as it was.

ERRORS (`ErrorLog`) is started afresh by every run: it lists the rows of that run that did not
reach OUTPUT, one JSON object a line (`rows.error_row`), each batch flushed and fsynced. A
rerun retries them, so after a run that finished every input row is in OUTPUT or in ERRORS.
ERRORS is locked like OUTPUT, before it is emptied: a second job naming it is refused.

`-` (`STDIO`) is the one name that is no file: OUTPUT `-` writes the rows to stdout with
nothing to resume (`OutputJournal.open` neither locks nor scans it), ERRORS `-` to stderr.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys

STDIO = "-"


class OutputError(ValueError):
    """OUTPUT cannot be resumed or written; the message names the file and why."""


def encode(rows: list) -> bytes:
    """Rows as JSON lines (ASCII, one per row)."""
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class OutputJournal:
    def __init__(self, path: str, fd: int, done: set, dropped_bytes: int):
        self.path, self.done, self.dropped_bytes = path, done, dropped_bytes
        self._fd = fd

    @classmethod
    def open(cls, path: str) -> "OutputJournal":
        """Lock OUTPUT (created if missing), read its ids, cut a torn last line; `-`: stdout,
        nothing to resume."""
        if path == STDIO:
            return cls(path, -1, set(), 0)
        fd = _open_locked(path, os.O_RDWR)
        try:
            done, end = scan_output(path, fd)
            size = os.fstat(fd).st_size
            if end < size:
                os.ftruncate(fd, end)
                os.fsync(fd)
            os.lseek(fd, end, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, done, size - end)

    def append(self, rows: list) -> list:
        """Write the rows whose ids are not in OUTPUT yet, then flush and fsync; returns them."""
        fresh = []
        for r in rows:
            if r["id"] not in self.done:
                self.done.add(r["id"])
                fresh.append(r)
        if fresh and self.path == STDIO:
            sys.stdout.write(encode(fresh).decode())
            sys.stdout.flush()
        elif fresh:
            _write_all(self._fd, encode(fresh))
            os.fsync(self._fd)
        return fresh

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1


def scan_output(path: str, fd: int) -> tuple[set, int]:
    """(the ids in OUTPUT, the byte offset after its last complete line); OutputError for a
    complete line that is not a JSON object with an id."""
    done, end = set(), 0
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        for line, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break  # the torn tail of a killed run
            end += len(raw)
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise OutputError(f"{path!r} line {line} is not JSON ({e}): not a batch job's "
                                  "output; move it away or pick another output") from None
            if not isinstance(row, dict) or not isinstance(row.get("id"), (str, int)):
                raise OutputError(f"{path!r} line {line} has no string or integer 'id': not "
                                  "a batch job's output; move it away or pick another output")
            done.add(row["id"])
    return done, end


def _open_locked(path: str, flags: int) -> int:
    """A file descriptor of `path` (created if missing) under an exclusive `flock`, or an
    OutputError naming the file when it cannot be opened or another job holds it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        fd = os.open(path, flags | os.O_CREAT, 0o644)
    except OSError as e:
        raise OutputError(f"cannot write {path!r}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputError(f"{path!r} is being written by another batch job; wait for it "
                          "or pick another path") from None
    return fd


class ErrorLog:
    """ERRORS, locked and emptied when opened (`-`: stderr); `append` writes a batch of error
    rows and fsyncs."""

    def __init__(self, path: str):
        self.path, self.count = path, 0
        if path == STDIO:
            self._file = None
            return
        fd = _open_locked(path, os.O_WRONLY)
        os.ftruncate(fd, 0)
        self._file = os.fdopen(fd, "wb")

    def append(self, rows: list) -> None:
        if rows and self._file is None:
            sys.stderr.write(encode(rows).decode())
            sys.stderr.flush()
        elif rows:
            self._file.write(encode(rows))
            self._file.flush()
            os.fsync(self._file.fileno())
        self.count += len(rows)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
