"""Opening a file store: a directory the environment refuses (missing, read-only, a file in the way, a full disk) is
StorageError naming the path and leaves no file behind; temporary files of writers that are gone are swept, those of
writers still at work are not."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.paths import TESTS
from helpers.storage import GEOMETRY, namespace, random_pages, read_pages

from kvtier.cache import page_keys
from kvtier.storage import FileStore, StorageError, open_store, temporaries
from kvtier.storage import file as file_module


def temporaries_left(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith(".tmp"))


def test_a_path_under_proc_is_refused_naming_it():
    with pytest.raises(StorageError, match="file store /proc/nope/kvtier: cannot make /proc/nope: No such file"):
        open_store("file:/proc/nope/kvtier", namespace())
    assert not os.path.exists("/proc/nope")


@pytest.mark.parametrize("blocker", ["root", "namespace", "parent"])
def test_a_file_where_a_directory_should_be_is_refused_naming_it(tmp_path, blocker):
    ns = namespace()
    root = tmp_path / "store"
    if blocker == "root":
        root.write_text("x")
        words = f"cannot make {root}/.*: Not a directory"
    elif blocker == "namespace":
        root.mkdir()
        (root / FileStore(tmp_path / "probe", ns).namespace_id).write_text("x")
        words = f"cannot make {root}/.*: File exists"
    else:
        tmp_path.joinpath("file").write_text("x")
        root = tmp_path / "file" / "store"
        words = f"cannot make {root}.*: Not a directory"
    with pytest.raises(StorageError, match=f"file store {root}: {words}"):
        open_store(f"file:{root}", ns)
    assert temporaries_left(tmp_path) == []


def read_only(monkeypatch) -> None:
    """The calls that make things fail as on a read-only mount (EEXIST still wins for what exists, as in Linux)."""
    def refuse(path, *args, **kwargs):
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path))
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    monkeypatch.setattr(os, "open", open_)
    import builtins

    real_builtin_open = builtins.open

    def builtin_open(path, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_builtin_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", builtin_open)


def test_a_new_store_on_a_read_only_filesystem_is_refused_naming_it(tmp_path, monkeypatch):
    read_only(monkeypatch)
    with pytest.raises(StorageError, match=f"file store {tmp_path}: cannot make {tmp_path}/.*: Read-only file"):
        open_store(f"file:{tmp_path}", namespace())
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_store_whose_record_exists_still_opens_read_only_and_serves_reads(tmp_path, monkeypatch):
    ns = namespace()
    keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
    pages = random_pages(3)
    with FileStore(tmp_path, ns) as writer:
        assert writer.set(keys[:2], [[p] for p in pages[:2]]) == 2
    read_only(monkeypatch)
    with FileStore(tmp_path, ns, retry_interval=0) as store:
        count, out = read_pages(store, keys[:2])
        assert count == 2 and all(np.array_equal(a, b) for a, b in zip(out, pages[:2], strict=True))
        assert store.set(keys[2:], [[pages[2]]]) == 0 and store.stats()["errors.set"] == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused_naming_it(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(StorageError, match=f"file store {tmp_path}: cannot make .*: Permission denied"):
            open_store(f"file:{tmp_path}", namespace())
    finally:
        tmp_path.chmod(0o755)
    assert list(tmp_path.iterdir()) == []


FULL_DISK = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {tests!r})
    from helpers.storage import GEOMETRY
    from kvtier.cache import Namespace
    from kvtier.storage import open_store
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))     # every file ends at 16 bytes, as on a full disk
    try:
        open_store("file:" + {root!r}, Namespace("test-model", GEOMETRY, "bfloat16"))
    except Exception as exc:
        print(type(exc).__name__, exc)
""")


def test_a_full_disk_at_open_is_refused_naming_the_record_and_leaves_no_temporary_file(tmp_path):
    child = subprocess.run([sys.executable, "-c", FULL_DISK.format(tests=str(TESTS), root=str(tmp_path))],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith(f"StorageError file store {tmp_path}: cannot write {tmp_path}/"), child.stdout
    assert "namespace.json: File too large" in child.stdout
    assert temporaries_left(tmp_path) == [] and not list(tmp_path.glob("*/namespace.json"))


KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from helpers.storage import GEOMETRY
    from kvtier.cache import Namespace
    from kvtier.storage import FileStore
    os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)   # killed between the write and the rename
    FileStore({root!r}, Namespace("test-model", GEOMETRY, "bfloat16", tenant={tenant!r}))
""")


def test_a_record_temporary_left_by_a_killed_opener_is_swept_by_the_next_open(tmp_path):
    ns = namespace()
    script = KILLED.format(tests=str(TESTS), root=str(tmp_path), tenant=ns.tenant)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    left = temporaries_left(tmp_path)
    assert [p.name.split(".")[1:3] for p in left] == [["namespace", str(child_pid(left[0]))]]
    store = FileStore(tmp_path, ns)
    assert temporaries_left(tmp_path) == []
    assert json.loads((store.directory / "namespace.json").read_text())["tenant"] == ns.tenant


def child_pid(path: Path) -> int:
    return int(path.name.split(".")[2])


def temporary(directory: Path, pid: int, *, page: bool = False, age: float = 0.0) -> Path:
    """A temporary file as a writer of ``pid`` names it (a record's, or a page's in a key directory), last written
    ``age`` seconds ago."""
    directory = directory / "ab" if page else directory
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (f".{'ab' * 32}.{pid}.140000.tmp" if page else f".namespace.{pid}.140000.tmp")
    path.write_bytes(b"half a page")
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


@pytest.fixture
def live_process():
    """Another running process (a writer at work, as far as the sweep can tell)."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield process
    process.stdin.close()
    process.wait(timeout=60)


def test_a_live_writers_temporary_files_are_kept(tmp_path, live_process):
    ns = namespace()
    directory = FileStore(tmp_path, ns).directory
    kept = [temporary(directory, live_process.pid), temporary(directory, live_process.pid, page=True)]
    FileStore(tmp_path, ns)
    assert all(p.exists() for p in kept)


def test_temporary_files_of_a_reused_pid_are_swept(tmp_path, live_process):
    """The file was last written an hour before the process now holding its pid started: another process wrote
    it (a restarted container gets the same pids)."""
    ns = namespace()
    directory = FileStore(tmp_path, ns).directory
    stale = [temporary(directory, live_process.pid, age=3600), temporary(directory, live_process.pid, page=True,
                                                                          age=3600)]
    FileStore(tmp_path, ns)
    assert not any(p.exists() for p in stale)


def test_temporary_files_of_a_dead_or_zombie_writer_are_swept(tmp_path):
    ns = namespace()
    directory = FileStore(tmp_path, ns).directory
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)      # exited, not reaped: a zombie
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True, timeout=60)
        stale = [temporary(directory, zombie.pid), temporary(directory, int(dead.stdout), page=True)]
        FileStore(tmp_path, ns)
        assert not any(p.exists() for p in stale)
    finally:
        zombie.wait(timeout=60)


def test_this_pids_own_leftovers_are_swept_but_not_what_its_threads_are_writing(tmp_path):
    """A file named with our own pid that none of our threads is writing was left by an earlier process that had
    this pid; one a thread of ours is writing stays."""
    ns = namespace()
    directory = FileStore(tmp_path, ns).directory
    leftover = temporary(directory, os.getpid())
    in_progress = directory / "ab" / f".{'cd' * 32}.{os.getpid()}.{threading.get_ident()}.tmp"
    with temporaries.writing(in_progress):
        in_progress.parent.mkdir(exist_ok=True)
        in_progress.write_bytes(b"being written")
        FileStore(tmp_path, ns)
        assert in_progress.exists() and not leftover.exists()


def test_a_store_opened_while_another_thread_writes_the_record_leaves_that_write_alone(tmp_path, monkeypatch):
    """Deterministically in the middle of one opener's record write (its temporary file written, not yet renamed),
    a second store opens the same directory from another thread and sweeps: the first open still succeeds."""
    ns = namespace()
    real_write = file_module.write_file
    others: list[FileStore] = []
    second = threading.Thread(target=lambda: others.append(FileStore(tmp_path, ns)))

    def write_then_let_another_open(path, data):
        real_write(path, data)
        if threading.current_thread() is not second:
            second.start()
            second.join(60)

    monkeypatch.setattr(file_module, "write_file", write_then_let_another_open)
    first = FileStore(tmp_path, ns)
    assert len(others) == 1 and (first.directory / "namespace.json").is_file() and temporaries_left(tmp_path) == []


def test_a_file_where_the_store_directory_should_be_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match=f"file store {blocker}: cannot make {blocker}/.*: Not a directory"):
        FileStore(blocker, namespace())
