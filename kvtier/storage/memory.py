"""``MemoryStore``: stored pages in a dict, for tests and single-process experiments.

It stores exactly what the other backends store (header + payload) and verifies the same way, so the cache's storage
logic can be exercised without a disk or a server. Stores built with one ``SharedPages`` share one dict (several
caches in one process, a "restart"), as a shared directory or server would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.locks import named_lock
from kvtier.storage.backend import Entry, StorageBackend
from kvtier.storage.format import PageRejected


class SharedPages:
    """The dict several MemoryStores share (namespace id → key → stored bytes), LRU-ordered, with one lock."""

    def __init__(self) -> None:
        self.lock = named_lock("storage.memory")
        self.pages: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self.namespaces: dict[str, dict[str, Any]] = {}


class MemoryStore(StorageBackend):
    kind = "memory"

    def __init__(self, namespace: Namespace | None, *, shared: SharedPages | None = None, max_bytes: int | None = None,
                 **options: Any) -> None:
        super().__init__(namespace, **options)
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
            raise InvalidArgument(f"max_bytes={max_bytes!r}: an int >= 1, or None")
        if shared is not None and not isinstance(shared, SharedPages):
            raise InvalidArgument(f"shared={shared!r:.60}: a SharedPages, or None for pages of this store's own")
        self.shared = SharedPages() if shared is None else shared
        self.max_bytes = max_bytes
        if namespace is not None:
            with self.shared.lock:
                self.shared.namespaces.setdefault(self.namespace_id, self.describe())

    def __repr__(self) -> str:
        return f"MemoryStore(namespace {self.namespace_id}, {len(self.shared.pages)} pages)"

    def _exists(self, keys: list[bytes]) -> list[bool]:
        with self.shared.lock:
            return [(self.namespace_id, k) in self.shared.pages for k in keys]

    def _get(self, keys: list[bytes], pages: list[list[memoryview]]) -> Iterator[PageRejected | None]:
        for key, pieces in zip(keys, pages, strict=False):
            with self.shared.lock:
                blob = self.shared.pages.get((self.namespace_id, key))
                if blob is not None:
                    self.shared.pages.move_to_end((self.namespace_id, key))
            if blob is None:
                yield PageRejected("absent", key.hex())
                continue
            try:
                payload = self.verify_blob(key, blob)
            except PageRejected as rejected:
                yield rejected
                continue
            at = 0
            for piece in pieces:
                piece[:] = payload[at:at + piece.nbytes]
                at += piece.nbytes
            yield None

    def _set(self, keys: list[bytes], pages: list[list[memoryview]]) -> int:
        blobs = [b"".join([self.format.header(key, pieces), *pieces]) for key, pieces in zip(keys, pages, strict=True)]
        with self.shared.lock:
            for key, blob in zip(keys, blobs, strict=False):
                self.shared.pages[(self.namespace_id, key)] = blob
                self.shared.pages.move_to_end((self.namespace_id, key))
            if self.max_bytes is not None:
                used = sum(len(b) for b in self.shared.pages.values())
                while used > self.max_bytes and self.shared.pages:
                    used -= len(self.shared.pages.popitem(last=False)[1])
                    self.counters.add("evicted_pages")
        return len(keys)

    def _delete(self, keys: list[bytes]) -> int:
        with self.shared.lock:
            return sum(self.shared.pages.pop((self.namespace_id, k), None) is not None for k in keys)

    def _entries(self) -> Iterator[Entry]:
        with self.shared.lock:
            items = [(ns, key, len(blob)) for (ns, key), blob in self.shared.pages.items()]
        return iter(Entry(ns, key.hex(), size) for ns, key, size in items)

    def _namespaces(self) -> dict[str, dict[str, Any] | None]:
        with self.shared.lock:
            return dict(self.shared.namespaces)

    def _remove(self, namespace_id: str | None) -> int:
        with self.shared.lock:
            doomed = [k for k in self.shared.pages if namespace_id is None or k[0] == namespace_id]
            for k in doomed:
                del self.shared.pages[k]
            return len(doomed)

    def corrupt(self, key: bytes, offset: int, value: int | None = None, *, truncate: int | None = None) -> None:
        """Tests: flip a byte (or set it to ``value``) or cut the stored page of ``key`` at ``truncate`` bytes."""
        with self.shared.lock:
            blob = bytearray(self.shared.pages[(self.namespace_id, key)])
            if truncate is not None:
                del blob[truncate:]
            elif blob:
                offset %= len(blob)
                blob[offset] = (blob[offset] ^ 0xFF) if value is None else value
            self.shared.pages[(self.namespace_id, key)] = bytes(blob)
