"""``FileStore``: the embedded default — one file per page under a directory.

Layout: ``ROOT/<namespace id>/<first two hex digits of the key>/<key hex>.kvp``, plus ``ROOT/<namespace id>/
namespace.json`` saying which model, geometry and dtype the namespace is. Several processes may share a directory:
what one writes is a hit for the others.

- **Atomic writes.** A page is written to a temporary file in its final directory (vectored ``pwritev``: header and
  the page's pieces, no copy), optionally synced (``fsync="data"``: the file before the rename; ``"full"``: the
  directory too), then renamed over the final name. A writer killed at any point leaves the old page or no page,
  never a torn one; its temporary file is swept by the next store that opens the directory once its writer is
  surely gone (:mod:`kvtier.storage.temporaries`). Without fsync a power loss may leave a torn page: the checksum
  makes that a miss.
- **One write per page.** A key names its content (the KV of a prefix in one namespace), so a page already stored
  in this store's format (or in another payload order, for caches of that layout) is not written again
  (``overwrite=True`` rewrites it); a page of another format version or with a damaged header is replaced by the next
  write of it, and a page found damaged on read is removed.
- **Reads** go straight into host memory (``preadv`` into the page's pieces) and are verified before the page counts.
- **Size bound.** ``max_bytes`` bounds the directory: past it, the least recently used pages (by modification time,
  which a hit refreshes) are removed down to 90% of the bound. Each process tracks what it writes and rescans the
  directory when its own view cannot explain the size, so sharing processes converge on the bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.locks import named_lock
from kvtier.storage.backend import Entry, PartialWrite, StorageBackend, StorageError
from kvtier.storage.format import HEADER_BYTES, PageRejected
from kvtier.storage.temporaries import sweep_temporaries, write_file, writing

SUFFIX = ".kvp"
PAYLOAD_OFFSET = 4096
"""A page file is the header, zeros up to this offset, then the payload: page-aligned payloads read from the page
cache ~25% faster than ones at the header's end (measured into pinned host memory)."""
RESCAN_SECONDS = 2.0
"""How often a bounded store rescans the directory while writing (it sees other processes' pages that way)."""
FSYNC_POLICIES = ("none", "data", "full")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _transfer(call: Any, fd: int, buffers: list[memoryview], offset: int) -> int:
    """Run ``preadv``/``pwritev`` until every buffer is done or the file ends; returns the bytes moved."""
    total = sum(b.nbytes for b in buffers)
    moved = 0
    while buffers:
        n = call(fd, buffers, offset + moved)
        if n <= 0:
            break
        moved += n
        while buffers and n >= buffers[0].nbytes:
            n -= buffers[0].nbytes
            buffers = buffers[1:]
        if buffers and n:
            buffers = [buffers[0][n:], *buffers[1:]]
    return moved if moved < total else total


class FileStore(StorageBackend):
    kind = "file"

    def __init__(self, root: str | os.PathLike[str], namespace: Namespace | None, *, max_bytes: int | None = None,
                 fsync: str = "none", overwrite: bool = False, **options: Any) -> None:
        """Opening makes the namespace's directory and record and sweeps dead writers' temporary files; a directory
        that cannot be made or written (read-only, missing parent, a file in the way, a full disk) is StorageError
        naming the path, and leaves no file behind. A store whose record is already there opens on a read-only
        directory: reads are served, writes count as failures."""
        super().__init__(namespace, **options)
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root) or "\0" in os.fspath(root):
            raise InvalidArgument(f"file store root {root!r}: a directory path")
        if not isinstance(fsync, str) or fsync not in FSYNC_POLICIES:
            raise InvalidArgument(f"fsync={fsync!r}: choose one of {', '.join(FSYNC_POLICIES)}")
        if not isinstance(overwrite, bool):
            raise InvalidArgument(f"overwrite={overwrite!r}: True or False")
        smallest = PAYLOAD_OFFSET + self.format.payload_bytes if namespace is not None else 1
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < smallest):
            raise InvalidArgument(f"max_bytes={max_bytes!r} must be an int of at least one stored page "
                                  f"({smallest} bytes)")
        self.root = Path(root)
        self.fsync, self.max_bytes, self.overwrite = fsync, max_bytes, overwrite
        self._made: set[str] = set()
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._lru_lock = named_lock("storage.file_lru")
        self._used = 0
        self._scanned = 0.0
        if namespace is None:                    # an operator's view: a missing directory holds no pages
            if self.root.exists() and not self.root.is_dir():
                raise StorageError(f"file store {self.root}: not a directory")
            self.directory = self.root
            return
        self.directory = self.root / self.namespace_id
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"file store {self.root}: cannot make {exc.filename or self.directory}: "
                               f"{exc.strerror or exc}") from None
        sweep_temporaries(self.root)
        self._record_namespace()
        if max_bytes is not None:
            self._rescan()

    @property
    def stored_bytes(self) -> int:
        return PAYLOAD_OFFSET + self.format.payload_bytes

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r}, namespace {self.namespace_id})"

    # -- paths ---------------------------------------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        hexkey = key.hex()
        return self.directory / hexkey[:2] / (hexkey + SUFFIX)

    def _record_namespace(self) -> None:
        """Write ``namespace.json`` unless it is there: to a temporary file renamed over it, removed if the write
        fails (a full disk must not leave one behind)."""
        record = self.directory / "namespace.json"
        if record.exists():
            return
        temporary = self.directory / f".namespace.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with writing(temporary):
                write_file(temporary, json.dumps(self.describe(), indent=1).encode())
                os.replace(temporary, record)
        except OSError as exc:
            raise StorageError(f"file store {self.root}: cannot write {record}: {exc.strerror or exc}") from None

    # -- the backend ---------------------------------------------------------------------------------------------------
    def _exists(self, keys: list[bytes]) -> list[bool]:
        return [self.path(k).is_file() for k in keys]

    def _get(self, keys: list[bytes], pages: list[list[memoryview]]) -> Iterator[PageRejected | None]:
        """Pages are read and verified on the store's I/O threads (``preadv`` and xxhash release the GIL), each
        checksummed by the thread that read it while it is in that core's caches; outcomes come in page order."""
        return self._ordered(self._read_page, keys, pages)

    def _read_page(self, key: bytes, pieces: list[memoryview]) -> PageRejected | None:
        path = self.path(key)
        try:                                       # non-blocking: a FIFO planted at a page's path must not hang us
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return PageRejected("absent", str(path))
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                return PageRejected("corrupt", f"{path} is not a regular file")
            block = os.pread(fd, PAYLOAD_OFFSET, 0)
            header = block[:HEADER_BYTES]
            try:
                checksum = self.format.check_header(header, key)
            except PageRejected as rejected:
                return rejected
            if status.st_size != PAYLOAD_OFFSET + self.format.payload_bytes:
                return PageRejected("short", f"{path} holds {status.st_size} bytes, a page is "
                                             f"{PAYLOAD_OFFSET + self.format.payload_bytes}")
            if block.count(0, HEADER_BYTES) != PAYLOAD_OFFSET - HEADER_BYTES:
                return PageRejected("corrupt", f"{path}: the padding after the header is not zeros")
            if _transfer(os.preadv, fd, list(pieces), PAYLOAD_OFFSET) != self.format.payload_bytes:
                return PageRejected("short", f"{path} ends inside its payload")
        finally:
            os.close(fd)
        try:
            self.format.check_payload(header, checksum, pieces)
        except PageRejected as rejected:
            return rejected
        self._touch(path, status.st_size)
        return None

    def _set(self, keys: list[bytes], pages: list[list[memoryview]]) -> int:
        """Pages are written on the store's I/O threads; a failure reports the pages before the first failed one."""
        for done, failure in enumerate(self._ordered(self._write_page, keys, pages, catch=True)):
            if failure is not None:
                raise PartialWrite(done, failure) from failure
        return len(keys)

    def _holds_own_page(self, path: Path, key: bytes) -> bool:
        """Whether ``path`` holds a page to keep: one whose header this store accepts for ``key`` (the payload is
        checked on read), or a page of another payload order (its readers' own). A page of another version or a
        damaged header must not block this store's write forever."""
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            self.format.check_header(os.pread(fd, HEADER_BYTES, 0), key)
            return True
        except PageRejected as rejected:
            return rejected.reason == "layout"          # another order's page is left to its readers
        except OSError:
            return False
        finally:
            os.close(fd)

    def _write_page(self, key: bytes, pieces: list[memoryview]) -> None:
        """Checksum, payload, then the header in front, then the rename over the page's name."""
        path = self.path(key)
        if not self.overwrite and self._holds_own_page(path, key):
            self.counters.add("set.already_stored")
            return
        parent = path.parent
        if parent.name not in self._made:
            if not self.directory.is_dir():
                self._reset()
            parent.mkdir(parents=True, exist_ok=True)
            self._made.add(parent.name)
        temporary = parent / f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp"
        with writing(temporary):
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o600)
            try:
                header = self.format.header(key, pieces).ljust(PAYLOAD_OFFSET, b"\0")
                written = _transfer(os.pwritev, fd, list(pieces), PAYLOAD_OFFSET)
                if written != self.format.payload_bytes:
                    raise OSError(f"short write to {temporary}")
                if os.pwrite(fd, header, 0) != len(header):
                    raise OSError(f"short write to {temporary}")
                if self.fsync != "none":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, path)
        if self.fsync == "full":
            directory = os.open(parent, os.O_RDONLY | _O_CLOEXEC)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        self._added(path, PAYLOAD_OFFSET + self.format.payload_bytes)

    def _reset(self, error: BaseException | None = None) -> None:
        """After an error: forget which directories exist and make the namespace's again (an operator may have
        removed it), so the next try starts afresh."""
        if self.closed:
            return
        self._made.clear()
        with contextlib.suppress(OSError, StorageError):
            self.directory.mkdir(parents=True, exist_ok=True)
            self._record_namespace()

    def _delete(self, keys: list[bytes]) -> int:
        removed = 0
        for key in keys:
            path = self.path(key)
            try:
                path.unlink()
                removed += 1
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
            with self._lru_lock:
                self._used -= self._lru.pop(str(path), 0)
        return removed

    def _namespace_dirs(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def _entries(self) -> Iterator[Entry]:
        for namespace in self._namespace_dirs():
            for path in namespace.glob(f"*/*{SUFFIX}"):
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue
                yield Entry(namespace.name, path.stem, size)

    def _namespaces(self) -> dict[str, dict[str, Any] | None]:
        found: dict[str, dict[str, Any] | None] = {}
        for namespace in self._namespace_dirs():
            try:
                found[namespace.name] = json.loads((namespace / "namespace.json").read_text())
            except (OSError, ValueError):
                found[namespace.name] = None
        return found

    def _remove(self, namespace_id: str | None) -> int:
        removed = 0
        for entry in list(self._entries()):
            if namespace_id is None or entry.namespace == namespace_id:
                path = self.root / entry.namespace / entry.key[:2] / (entry.key + SUFFIX)
                try:
                    path.unlink()
                    removed += 1
                except FileNotFoundError:
                    pass
        with self._lru_lock:
            for name in [n for n in self._lru if not os.path.exists(n)]:
                self._used -= self._lru.pop(name)
        return removed

    # -- the size bound ------------------------------------------------------------------------------------------------
    def _touch(self, path: Path, size: int) -> None:
        if self.max_bytes is None:
            return
        name = str(path)
        with self._lru_lock:
            if name in self._lru:
                self._lru.move_to_end(name)
            else:
                self._lru[name] = size
                self._used += size
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)

    def _added(self, path: Path, size: int) -> None:
        if self.max_bytes is None:
            return
        name = str(path)
        with self._lru_lock:
            self._used += size - self._lru.pop(name, 0)
            self._lru[name] = size
            over = self._used > self.max_bytes
            stale = time.monotonic() - self._scanned > RESCAN_SECONDS
        if over or stale:                        # other processes write here too: look again now and then
            self._shrink()

    def _shrink(self) -> None:
        assert self.max_bytes is not None
        target = int(self.max_bytes * 0.9)
        with self._lru_lock:
            if time.monotonic() - self._scanned > min(1.0, RESCAN_SECONDS):
                self._rescan_locked()
            victims = []
            while self._used > target and self._lru:
                name, size = self._lru.popitem(last=False)
                self._used -= size
                victims.append(name)
        for name in victims:
            try:
                os.unlink(name)
            except FileNotFoundError:
                continue
            self.counters.add("evicted_pages")

    def _rescan(self) -> None:
        with self._lru_lock:
            self._rescan_locked()

    def _rescan_locked(self) -> None:
        """The whole directory (every namespace and process), oldest first."""
        found = []
        for path in self.root.glob(f"*/*/*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            found.append((stat.st_mtime_ns, str(path), stat.st_size))
        found.sort()
        self._lru = OrderedDict((name, size) for _, name, size in found)
        self._used = sum(size for _, _, size in found)
        self._scanned = time.monotonic()

    @property
    def used_bytes(self) -> int:
        """Bytes of pages this store knows of in its directory (all namespaces; exact after a rescan)."""
        with self._lru_lock:
            if self.max_bytes is None:
                self._rescan_locked()
            return self._used
