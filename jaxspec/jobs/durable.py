"""Appends that leave only whole lines: a write that fails part-way (a full disk) is cut back off
before the error is raised, and resume cuts a torn final line that a kill left behind."""

from __future__ import annotations

import os
from pathlib import Path

from jaxspec.errors import JaxspecError


class WriteError(JaxspecError):
    """A job's file could not be written (a full disk, a quota): nothing torn was left in it."""

    def __init__(self, path: Path, error: OSError):
        self.path, self.strerror = Path(path), error.strerror or str(error)
        super().__init__(f"cannot write {self.path}: {self.strerror}")


def append_whole(fd: int, data: bytes, path: Path, sync: bool = True) -> None:
    """Appends `data` to the file open at `fd` (fsynced when `sync`), or none of it: on an OSError
    the file is truncated back to its size before, and WriteError names `path`."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view, done = memoryview(data), 0
    try:
        while done < len(view):
            done += os.write(fd, view[done:])
        if sync:
            os.fsync(fd)
    except OSError as e:
        try:
            os.ftruncate(fd, start)
        except OSError:  # resume's repair_tail cuts whatever stays torn
            pass
        raise WriteError(path, e) from e


def repair_tail(path: Path) -> int:
    """Truncates a torn final line (a write cut short by a kill); returns the bytes removed."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:
            start = max(0, keep - 65536)
            f.seek(start)
            block = f.read(keep - start)
            if keep == size and block.endswith(b"\n"):
                return 0
            cut = block.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            keep = start
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return size - keep
