"""The stores a vLLM connector has open: one per namespace in use (a request's adapter and salt, and in the scheduler
each tensor-parallel rank's), since a store keeps each namespace's pages apart. Opened on first use, the least
recently used closed past ``OPEN_STORES``; a worker's are registered with its host pool (``HostPages``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.keys import Namespace
from kvtier.locks import named_lock
from kvtier.pools import HostPool
from kvtier.storage import HostPages, StorageBackend, open_store

OPEN_STORES = 8


class OpenStores:
    def __init__(self, spec: str, options: dict[str, Any], layout: Any, pool: HostPool | None = None) -> None:
        self.spec, self.options, self.layout, self.pool = spec, options, layout, pool
        self._open: OrderedDict[bytes, tuple[StorageBackend, HostPages | None]] = OrderedDict()
        self._leases: dict[bytes, int] = {}
        self._lock = named_lock("vllm.stores")

    @contextmanager
    def lease(self, namespace: Namespace) -> Iterator[tuple[StorageBackend, HostPages | None]]:
        """The store of ``namespace`` (opened on first use), kept open while the caller holds it: another thread's
        use of a ninth namespace closes the least recently used store no one holds, never one in use."""
        digest = namespace.digest
        with self._lock:
            held = self._open.get(digest)
            if held is None:
                store = open_store(self.spec, namespace, layout=self.layout, **self.options)
                try:
                    held = (store, HostPages(self.pool, store) if self.pool is not None else None)
                except BaseException:
                    store.close()
                    raise
                self._open[digest] = held
            self._open.move_to_end(digest)
            self._leases[digest] = self._leases.get(digest, 0) + 1
            self._trim()
        try:
            yield held
        finally:
            with self._lock:
                self._leases[digest] -= 1
                if not self._leases[digest]:
                    del self._leases[digest]
                self._trim()

    def _trim(self) -> None:
        idle = [digest for digest in self._open if digest not in self._leases]
        for digest in idle[:max(0, len(self._open) - OPEN_STORES)]:
            _close(self._open.pop(digest))

    def first(self) -> StorageBackend | None:
        """The most recently used store (its read rate stands for the others')."""
        with self._lock:
            return next(reversed(self._open.values()))[0] if self._open else None

    def close(self) -> None:
        with self._lock:
            held, self._open = list(self._open.values()), OrderedDict()
        for pair in held:
            _close(pair)


def _close(pair: tuple[StorageBackend, HostPages | None]) -> None:
    store, pages = pair
    if pages is not None:
        pages.close()
    store.close()
