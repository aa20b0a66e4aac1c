"""The file store's temporary files, and the sweep that removes the ones their writers left behind.

A page or a namespace record is written to ``.<name>.<pid>.<thread>.tmp`` in its final directory, then renamed over
its final name: a writer killed mid-write leaves that file, never a torn page. A store that opens sweeps such files,
but only those whose writer is surely gone, because processes that share the directory may be writing right now:

- a file of another pid is removed when no such process runs (or it is a zombie), or when the process with that
  pid started after the file was last written (the pid was reused: a container restarted, say);
- a file of this very pid is removed unless one of this process's threads is writing it (a previous process had our
  pid: containers restart with the same pids).

Pids are only meaningful among the processes of one machine (one pid namespace): that is who may share a directory.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

from kvtier.locks import named_lock

CLOCK_SLACK = 60.0
"""Seconds a file must predate its pid's process before it counts as another process's (wall clocks get stepped)."""
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_writing: set[str] = set()
_writing_lock = named_lock("storage.temporaries", fork_safe=True)


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Marks ``path`` as being written by this process for the block (the sweep leaves it alone), and removes it if
    the block fails: a failed write leaves nothing behind."""
    with _writing_lock:
        _writing.add(path.name)
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        with _writing_lock:
            _writing.discard(path.name)


def write_file(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path`` (made, mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def sweep_temporaries(root: Path) -> int:
    """Remove the temporary files under ``root`` (records: ``*/``, pages: ``*/*/``) whose writers are gone;
    returns how many. Files that cannot be removed (a read-only directory) are left."""
    removed = 0
    for path in itertools.chain(root.glob("*/.*.tmp"), root.glob("*/*/.*.tmp")):
        pid = writer_of(path.name)
        if pid is not None and _writer_gone(pid, path):
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def writer_of(name: str) -> int | None:
    """The pid in a temporary file's name, or None for a name the store does not make."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] or parts[4] != "tmp" or not (parts[2].isdigit() and parts[3].isdigit()):
        return None
    pid = int(parts[2])
    return pid if pid > 0 else None


def _writer_gone(pid: int, path: Path) -> bool:
    if pid == os.getpid():
        with _writing_lock:
            return path.name not in _writing
    process = _process(pid)
    if process is None:
        return not _alive(pid)
    state, started = process
    if state == "Z":
        return True
    try:
        modified = path.stat().st_mtime
    except OSError:
        return False
    return modified < started - CLOCK_SLACK


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process(pid: int) -> tuple[str, float] | None:
    """(state, start time in seconds since the epoch) of a running process, from ``/proc``; None where there is no
    such process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        with open("/proc/stat", "rb") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith(b"btime "))
        return fields[0].decode(), boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
