"""The storage backend interface: a new store subclasses :class:`StorageBackend` and writes these primitives, the
abstract methods (a subclass missing one cannot be instantiated: the TypeError names it). Keys are 32-byte page keys,
already checked; pages are lists of CPU byte views. A primitive may raise anything on a store error: the base turns it
into misses and counts (see below).

- ``StorageBackend._exists(keys)`` → one bool per key: whether the store holds it.
- ``StorageBackend._get(keys, pages)`` → an iterator, per page in order: None once read and verified, else why not.
- ``StorageBackend._set(keys, pages)`` → how many pages it stored behind their headers; PartialWrite if cut short.
- ``StorageBackend._delete(keys)`` → how many of these pages were there (now removed).
- ``StorageBackend._entries()`` → an iterator of :class:`Entry`: every stored page of every namespace.
- ``StorageBackend._namespaces()`` → namespace id → the description its writers recorded (None when unknown).
- ``StorageBackend._remove(namespace_id)`` → how many pages of that namespace (None: of every one) it removed.

Optional hooks, with defaults here: ``register_memory(address, nbytes)`` / ``unregister_memory(address)`` (host
memory, by CPU address, that a store with its own transfer engine registers once; nothing), ``_reset(error)`` (drop
connections after an error; nothing) and ``_close()`` (release files and connections; nothing).
``verify_blob`` and ``_ordered`` are helpers for ``_get`` and ``_set``.

A backend stores whole pages of one namespace under their page keys (the SHA-256 chain of :mod:`kvtier.keys`).
Callers hand it CPU-domain buffers (views of host pages, numpy arrays, CPU tensors): it never sees a device address.
The public calls, which the base implements over the primitives:

- ``exists(keys)`` → how many leading keys are stored (the stored prefix of a chain); ``present(keys)`` → per key,
  whether it is stored.
- ``get(keys, pages)`` reads into ``pages`` (one list of buffers per page) and returns how many *leading* pages were
  read and verified: a page that is absent, short, corrupt or written under another namespace, key, geometry or
  format ends the chain (counted by reason); nothing after it is read.
- ``set(keys, pages)`` stores pages (header + bytes); ``delete(keys)``; ``close()``; ``stats()``.

Errors never escape: an exception from the store (a server down, a disk full) becomes misses, skipped writes and an
error count, and the backend stays "down" for ``retry_interval`` seconds (calls return at once as misses) before it
tries again; the first success after that counts a reconnect.
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.address import CpuAddress
from kvtier.checks import positive_number
from kvtier.errors import InvalidArgument, KvtierError
from kvtier.keys import Namespace
from kvtier.locks import named_lock
from kvtier.pools.geometry import HostLayout
from kvtier.storage.format import HEADER_BYTES, PageFormat, PageRejected

Pieces = Sequence[Any]
KEY_BYTES = 32


class StorageError(KvtierError):
    """A store cannot be used: its environment refused it when it opened (a directory that cannot be made or
    written: read-only, missing, full), or it was used after close."""


class PartialWrite(Exception):
    """A backend's ``_set`` stored the first ``stored`` pages, then failed."""

    def __init__(self, stored: int, cause: BaseException) -> None:
        super().__init__(f"{stored} pages stored, then {type(cause).__name__}: {cause}")
        self.stored = stored


READ, WRITE = "read", "write"


def _attempt(work: Callable[..., Any], row: tuple[Any, ...]) -> BaseException | None:
    try:
        work(*row)
    except Exception as exc:  # noqa: BLE001 - handed to the caller, in order
        return exc
    return None


def settle(futures: list[Future[Any]]) -> None:
    """Cancel what has not started; wait for the rest."""
    for future in futures:
        future.cancel()
    wait(futures)


class _InOrder:
    """The results of some futures in order; ``close()`` (a consumer that stops early) or a failed one settles them
    all. An iterator rather than a generator: one closed before its first item settles too."""

    def __init__(self, futures: list[Future[Any]]) -> None:
        self.futures, self.at = futures, 0

    def __iter__(self) -> _InOrder:
        return self

    def __next__(self) -> Any:
        if self.at == len(self.futures):
            raise StopIteration
        self.at += 1
        try:
            return self.futures[self.at - 1].result()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        settle(self.futures)


@dataclass(frozen=True)
class Entry:
    """A stored page as an operator sees it: namespace (16 hex digits), key (hex) and stored size in bytes."""

    namespace: str
    key: str
    nbytes: int


def byte_view(piece: Any, what: str = "page buffer") -> memoryview:
    """A flat byte view of a CPU buffer; refuses GPU tensors (storage never sees a device address) and
    non-contiguous views with an error that says so."""
    if hasattr(piece, "untyped_storage"):           # a torch tensor
        if piece.device.type != "cpu":
            raise InvalidArgument(f"{what} lives on {piece.device}: storage reads and writes CPU memory only (a "
                                  f"host page's CPU view), never a device address")
        if not piece.is_contiguous():
            raise InvalidArgument(f"{what} is a non-contiguous tensor view; storage moves whole contiguous pieces")
        import torch

        piece = piece.reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(piece)
    except TypeError:
        raise InvalidArgument(f"{what} is a {type(piece).__name__}, not a buffer (a host page view, numpy array or "
                              f"CPU tensor)") from None
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} is not contiguous; storage moves whole contiguous pieces")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def scatter(data: memoryview, pieces: Sequence[memoryview]) -> None:
    """Copy one verified buffer into a page's pieces, in order (numpy's copy releases the GIL)."""
    source = np.frombuffer(data, np.uint8)
    at = 0
    for piece in pieces:
        np.copyto(np.asarray(piece), source[at:at + piece.nbytes])
        at += piece.nbytes


class StorageStats:
    """Thread-safe counters; ``snapshot()`` is a plain dict."""

    def __init__(self) -> None:
        self._lock = named_lock("storage.stats")
        self._counts: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + value

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)


class StorageBackend(abc.ABC):
    """Base class: batching, verification bookkeeping, the down/up state machine and counters. Subclasses implement
    the primitives listed at the top of this module."""

    kind = "abstract"
    exists_batch: int | None = None
    """Keys per ``_exists`` call (None: ``batch_pages``): a store that answers many keys in one round trip raises it,
    so a long chain's stored prefix is found in one."""

    def __init__(self, namespace: Namespace | None, *, retry_interval: float = 1.0, batch_pages: int = 32,
                 io_threads: int | None = None, layout: HostLayout | str = HostLayout.PAGE_FIRST) -> None:
        """``namespace=None`` opens the store for operators (list, describe, clear): page calls are refused.
        ``io_threads``: threads that read, write and verify the pages of a batch side by side (default: up to 4).
        ``layout``: the host layout of the pages given to ``get``/``set`` (it orders their bytes; a cache refuses a
        store opened for another order than its host pool's)."""

        if namespace is not None and not isinstance(namespace, Namespace):
            raise InvalidArgument(f"namespace={namespace!r:.60}: a kvtier.cache.Namespace, or None for operators")
        retry_interval = positive_number(retry_interval, "retry_interval", zero=True, unit="seconds")
        if type(batch_pages) is not int or batch_pages < 1:
            raise InvalidArgument(f"batch_pages={batch_pages!r}: an int >= 1")
        self._namespace = namespace
        self.layout = HostLayout(layout)
        self._format = PageFormat.of(namespace, self.layout) if namespace is not None else None
        self.namespace_id = namespace.digest.hex()[:16] if namespace is not None else ""
        if io_threads is not None and (type(io_threads) is not int or io_threads < 1):
            raise InvalidArgument(f"io_threads={io_threads!r}: an int >= 1, or None")
        self.retry_interval, self.batch_pages = float(retry_interval), int(batch_pages)
        self.io_threads = io_threads or max(1, min(4, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self.counters = StorageStats()
        self._state_lock = named_lock("storage.state")
        self._down_until = {READ: 0.0, WRITE: 0.0}
        self._down = {READ: False, WRITE: False}
        self._failed_at = {READ: 0.0, WRITE: 0.0}
        self.last_error = ""
        self._closed = False

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The keyword options this backend's constructor takes (its own and the shared ones), so ``open_store``
        can name a misspelt one instead of failing with a TypeError."""
        names: set[str] = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None and klass is not object:
                names.update(p.name for p in inspect.signature(init).parameters.values() if p.kind is p.KEYWORD_ONLY)
        return frozenset(names)

    # -- public -----------------------------------------------------------------------------------------------------
    @property
    def namespace(self) -> Namespace:
        if self._namespace is None:
            raise StorageError(f"{self!r} was opened without a namespace (for operators: entries, namespaces, clear)")
        return self._namespace

    @property
    def format(self) -> PageFormat:
        if self._format is None:
            raise StorageError(f"{self!r} was opened without a namespace (for operators: entries, namespaces, clear)")
        return self._format

    @property
    def page_bytes(self) -> int:
        return self.format.payload_bytes

    @property
    def stored_bytes(self) -> int:
        """What one stored page takes in the store (header and payload)."""
        return self.format.stored_bytes

    @property
    def up(self) -> bool:
        """Neither reads nor writes are failing (each goes down on its own: a full disk still serves reads)."""
        return not any(self._down.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored (0 when the store is down)."""
        total = 0
        for batch, hits in self._lookups(self._keys(keys)):
            run = next((i for i, hit in enumerate(hits) if not hit), len(batch))
            total += run
            if run < len(batch):
                break
        return total

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether it is stored (False from where the store went down): ``exists`` gives the stored prefix
        of a chain, this which of some independent keys are there (a hybrid cache asks which pages of a stored chain
        have a state snapshot)."""
        keys = self._keys(keys)
        found = [hit for _, hits in self._lookups(keys) for hit in hits]
        return found + [False] * (len(keys) - len(found))

    def _lookups(self, keys: list[bytes]) -> Iterator[tuple[list[bytes], list[bool]]]:
        """Batches of ``keys`` (``exists_batch`` or ``batch_pages`` at a time) with what the store says of each, in
        order, until the store is down; a caller that stops early asks no more."""
        step = self.exists_batch or self.batch_pages
        for start in range(0, len(keys), step):
            batch = keys[start:start + step]
            hits = self._guarded("exists", READ, lambda b=batch: self._exists(b), None,
                                 skipped="exists.skipped_down")
            if hits is None:
                return
            yield batch, [bool(hit) for hit in hits]

    def get(self, keys: Sequence[bytes], pages: Sequence[Pieces]) -> int:
        """Read the pages of ``keys`` into ``pages`` (per page, its buffers in order) and return how many leading
        pages were read and verified. Buffers of pages past that count may have been written: treat them as
        garbage."""
        keys = self._keys(keys)
        if len(pages) != len(keys):
            raise InvalidArgument(f"get: {len(keys)} keys but {len(pages)} pages")
        views = [self._pieces(p, i, into=True) for i, p in enumerate(pages)]
        start_time = time.perf_counter()
        done = 0
        for start, end in self._batches(keys):
            batch_keys, batch_views = keys[start:end], views[start:end]
            ok = self._guarded("get", READ, lambda k=batch_keys, v=batch_views: self._read_batch(k, v), 0,
                               skipped="miss.down")
            done += ok
            if ok < len(batch_keys):
                break
        self.counters.add("get.pages", len(keys))
        self.counters.add("get.hit_pages", done)
        if done < len(keys):
            self.counters.add("get.truncated_pages", len(keys) - done - 1)
        if done:
            self.counters.add("get.bytes", done * self.page_bytes)
            self.counters.add("get.seconds", time.perf_counter() - start_time)
        return done

    def set(self, keys: Sequence[bytes], pages: Sequence[Pieces]) -> int:
        """Store the pages of ``keys`` from ``pages``; returns how many were stored (0 when the store is down)."""
        keys = self._keys(keys)
        if len(pages) != len(keys):
            raise InvalidArgument(f"set: {len(keys)} keys but {len(pages)} pages")
        views = [self._pieces(p, i) for i, p in enumerate(pages)]
        start_time = time.perf_counter()
        stored = 0
        for start, end in self._batches(keys):
            batch_keys, batch_views = keys[start:end], views[start:end]
            written = self._guarded("set", WRITE, lambda k=batch_keys, v=batch_views: self._set(k, v), None,
                                    skipped="set.skipped_down")
            stored += written or 0
            if written != len(batch_keys):
                self.counters.add("set.failed_pages", len(keys) - stored)
                break
        if stored:
            self.counters.add("set.pages", stored)
            self.counters.add("set.bytes", stored * self.page_bytes)
            self.counters.add("set.seconds", time.perf_counter() - start_time)
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove these pages; returns how many were there."""
        keys = self._keys(keys)
        removed = self._guarded("delete", WRITE, lambda: self._delete(keys), 0) if keys else 0
        self.counters.add("deleted_pages", removed)
        return removed

    def entries(self) -> Iterator[Entry]:
        """Every stored page of every namespace in this store (operators: ``kvtier storage ls``). Raises on error:
        this is an operator's call, not the serving path."""
        self._check_open()
        return self._entries()

    def namespaces(self) -> dict[str, dict[str, Any] | None]:
        """Namespace id (16 hex digits) → the namespace's description, as its writers recorded it."""
        self._check_open()
        return self._namespaces()

    def clear(self, namespace_id: str | None = None, *, every_namespace: bool = False) -> int:
        """Remove the pages of this store's namespace, of ``namespace_id`` (16 hex digits, as ``entries`` lists
        them), or of every namespace; returns how many. Raises on error (an operator's call)."""
        self._check_open()
        if every_namespace:
            return self._remove(None)
        target = namespace_id or self.namespace_id
        if not target:
            raise InvalidArgument("clear: name a namespace id or pass every_namespace=True")
        if len(target) != 16 or any(c not in "0123456789abcdef" for c in target):
            raise InvalidArgument(f"clear: namespace id {target!r} is not 16 lowercase hex digits")
        return self._remove(target)

    def stats(self) -> dict[str, Any]:
        counts: dict[str, Any] = dict(self.counters.snapshot())
        counts.update({"kind": self.kind, "up": self.up, "namespace": self.namespace_id})
        for op in ("get", "set"):
            seconds = counts.get(f"{op}.seconds", 0.0)
            counts[f"{op}.gbps"] = counts.get(f"{op}.bytes", 0) / seconds / 1e9 if seconds else 0.0
        return counts

    def close(self) -> None:
        """Release connections and files. Idempotent; later calls raise StorageError."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._close()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> dict[str, Any]:
        """What a namespace record holds (so operators can tell namespaces apart)."""
        return {"digest": self.namespace.digest.hex(), **json.loads(self.namespace.canonical())}

    # -- rules shared by every backend ------------------------------------------------------------------------------
    def _read_batch(self, keys: list[bytes], views: list[list[memoryview]]) -> int:
        outcomes = self._get(keys, views)
        try:
            return self._count(keys, outcomes)
        finally:                                       # a backend with work in flight finishes it before we return
            close = getattr(outcomes, "close", None)
            if close is not None:
                close()

    def _count(self, keys: list[bytes], outcomes: Iterator[PageRejected | None]) -> int:
        done = 0
        for key, outcome in zip(keys, outcomes, strict=False):
            if outcome is not None:
                self.counters.add(f"miss.{outcome.reason}")
                if outcome.reason not in ("absent", "format", "layout"):   # the next write of it replaces it
                    # (a page of another format version or payload order is left to its readers)
                    with contextlib.suppress(Exception):
                        self.counters.add("removed_bad_pages", self._delete([key]))
                return done
            done += 1
        return done

    def _guarded(self, op: str, direction: str, call: Any, failed: Any, skipped: str | None = None) -> Any:
        """Run ``call`` unless ``direction`` (reads or writes) is down; an exception marks it down and returns
        ``failed`` (a ``PartialWrite`` returns how many pages it did store)."""
        self._check_open()
        started = time.monotonic()
        with self._state_lock:
            if self._down[direction] and started < self._down_until[direction]:
                if skipped:
                    self.counters.add(skipped)
                return failed
        try:
            result = call()
        except (InvalidArgument, StorageError):
            raise
        except Exception as exc:  # noqa: BLE001 - degrade, never fail: counted, the caller sees a miss
            if self._closed:
                raise StorageError(f"{self!r} was closed during the call") from exc
            self.counters.add(f"errors.{op}")
            self._reset(exc)
            with self._state_lock:
                self._down[direction] = True
                self._failed_at[direction] = time.monotonic()
                self._down_until[direction] = self._failed_at[direction] + self.retry_interval
                self.last_error = f"{type(exc).__name__}: {exc}"
            return exc.stored if isinstance(exc, PartialWrite) else failed
        with self._state_lock:                  # only a call begun after the last failure shows the store is back
            if self._down[direction] and started > self._failed_at[direction]:
                self._down[direction] = False
                self.counters.add("reconnects")
        return result

    def _batches(self, keys: list[bytes]) -> Iterator[tuple[int, int]]:
        """(start, end) of the batches of ``keys``: ``batch_pages`` at most, and never one key twice in a batch (a
        store may move a batch's keys at once: Mooncake fills one buffer of a key named twice, and the other then
        fails its checksum as if the stored page were corrupt)."""
        start, seen = 0, set[bytes]()
        for i, key in enumerate(keys):
            if i - start == self.batch_pages or key in seen:
                yield start, i
                start, seen = i, set()
            seen.add(key)
        if start < len(keys):
            yield start, len(keys)

    def _keys(self, keys: Sequence[bytes]) -> list[bytes]:
        keys = list(keys)
        for key in keys:
            if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
                raise InvalidArgument(f"a page key is {KEY_BYTES} bytes (kvtier.cache.page_keys), got {key!r:.40}")
        return [bytes(k) for k in keys]

    def _pieces(self, page: Pieces, index: int, *, into: bool = False) -> list[memoryview]:
        pieces = [byte_view(p, f"page {index}") for p in (page if isinstance(page, (list, tuple)) else [page])]
        if into and any(p.readonly for p in pieces):
            raise InvalidArgument(f"page {index}: a buffer to read into is read-only")
        total = sum(p.nbytes for p in pieces)
        if total != self.page_bytes:
            raise InvalidArgument(f"page {index} has {total} bytes in its buffers; a page of this namespace is "
                                  f"{self.page_bytes}")
        return pieces

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError(f"{self!r} is closed")

    # -- what a backend implements ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _exists(self, keys: list[bytes]) -> list[bool]:
        """Per key, whether the store holds it."""

    @abc.abstractmethod
    def _get(self, keys: list[bytes], pages: list[list[memoryview]]) -> Iterator[PageRejected | None]:
        """Per page in order: None when it was read into its buffers and verified (``verify_blob`` or
        ``self.format``), else why not. The consumer stops at the first failure."""

    @abc.abstractmethod
    def _set(self, keys: list[bytes], pages: list[list[memoryview]]) -> int:
        """Store the pages, each behind its header (``self.format.header`` or, streaming, ``digest``/``sealed``);
        returns how many (all of them). A failure after some were stored raises ``PartialWrite(stored, cause)``."""

    @abc.abstractmethod
    def _delete(self, keys: list[bytes]) -> int:
        """Remove these pages; how many were there."""

    @abc.abstractmethod
    def _entries(self) -> Iterator[Entry]:
        """Every stored page of every namespace."""

    @abc.abstractmethod
    def _namespaces(self) -> dict[str, dict[str, Any] | None]:
        """Namespace id → the description its writers recorded (None when there is none)."""

    @abc.abstractmethod
    def _remove(self, namespace_id: str | None) -> int:
        """Remove every page of ``namespace_id`` (None: of every namespace); how many."""

    def _ordered(self, work: Callable[..., Any], *columns: Sequence[Any], catch: bool = False) -> Iterator[Any]:
        """``work(*row)`` for every row of ``columns`` on the store's I/O threads, results in row order (with
        ``catch``, each row's exception or None). Stopped early, it waits for the rows in flight, so no thread
        still touches a caller's buffers when the call returns."""
        rows = list(zip(*columns, strict=True))
        if self.io_threads == 1 or len(rows) < 2:
            for row in rows:
                yield _attempt(work, row) if catch else work(*row)
            return
        futures: list[Future[Any]] = []
        try:
            pool = self._io_pool()
            for row in rows:
                futures.append(self._submit(pool, _attempt, work, row) if catch else self._submit(pool, work, *row))
        except BaseException:
            settle(futures)
            raise
        yield from self._in_order(futures)

    def _io_pool(self) -> ThreadPoolExecutor:
        """The store's I/O threads (``io_threads`` of them), made on first use."""
        with self._state_lock:
            self._check_open()
            if self._pool is None or self._pool_pid != os.getpid():   # a fork child has none of the threads
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"kvtier-{self.kind}-io")
                self._pool_pid = os.getpid()
            return self._pool

    def _submit(self, pool: ThreadPoolExecutor, work: Callable[..., Any], *row: Any) -> Future[Any]:
        try:
            return pool.submit(work, *row)
        except RuntimeError:                     # the store was closed meanwhile
            raise StorageError(f"{self!r} was closed during the call") from None

    @staticmethod
    def _in_order(futures: list[Future[Any]]) -> Iterator[Any]:
        """The results of ``futures`` in order. Closed early (``_read_batch`` closes what ``_get`` returns), it
        cancels those not started and waits for the others, so no thread still touches a caller's buffers when the
        call returns."""
        return _InOrder(futures)

    def register_memory(self, address: CpuAddress, nbytes: int) -> None:  # noqa: B027 (optional: most need none)
        """Host memory that pages will be read into and written from, by its CPU address: a store that moves
        pages with its own engine (Mooncake) registers it once, so they move with no copy. Others need nothing."""

    def unregister_memory(self, address: CpuAddress) -> None:  # noqa: B027 (optional, as register_memory)
        """Forget memory given to :meth:`register_memory` (before it is freed)."""

    def _reset(self, error: BaseException) -> None:  # noqa: B027 (an optional hook: nothing to drop by default)
        """After ``error``: drop what a fresh start needs dropped (connections), without breaking calls of other
        threads still in flight."""

    def _close(self) -> None:  # noqa: B027 (an optional hook: nothing to release by default)
        """Release files and connections (once, at ``close``)."""

    def verify_blob(self, key: bytes, blob: Any) -> memoryview:
        """Check a stored value (header + payload as one buffer); returns the payload view or raises PageRejected."""
        view = memoryview(blob)
        checksum = self.format.check_header(view[:HEADER_BYTES], key)
        payload = view[HEADER_BYTES:]
        self.format.check_payload(view[:HEADER_BYTES], checksum, [payload])
        return payload
