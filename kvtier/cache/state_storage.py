"""A hybrid cache's state snapshots in storage: which pages of a stored chain have one, and reading or writing them
between host state slots and the store.

A snapshot is stored beside the KV pages of its prefix, in the same store, as a value of the state snapshot format
(:mod:`kvtier.storage.snapshots`) under the key :func:`kvtier.keys.state_key` derives from the prefix's last page key.
So the rules of stored pages hold for it: verified on every read (header and checksum), absent or damaged is a
counted miss, a store error a miss. The storage tier decides what to read and write; this module only moves bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.keys import state_key
from kvtier.pools.state import StateHostPool
from kvtier.storage import HostPages, StateFormat, StorageBackend, state_snapshots


class StoredStates:
    def __init__(self, backend: StorageBackend, host_pool: StateHostPool) -> None:
        """Snapshots of ``host_pool``'s geometry and layout, in ``backend``'s namespace."""
        self.store = state_snapshots(backend, StateFormat.of(backend.namespace, host_pool.geometry, host_pool.layout))
        self.slots = HostPages(host_pool, self.store)
        self.slot_bytes = host_pool.geometry.slot_bytes

    def stored_ends(self, page_keys: Sequence[bytes]) -> list[int]:
        """The prefixes of a chain (its first ``n`` pages, ``n`` ascending) whose snapshot the store holds; none
        when the store is down."""
        found = self.store.present([state_key(key) for key in page_keys])
        return [i + 1 for i, hit in enumerate(found) if hit]

    def read(self, page_key: bytes, slot: int) -> bool:
        """Read the snapshot after ``page_key``'s page into host state ``slot``: True once it is there and verified
        (otherwise the slot holds garbage)."""
        with self.slots.batch(np.array([slot], dtype=np.int64)) as io:
            return self.store.get([state_key(page_key)], io.pages) == 1

    def write(self, page_keys: Sequence[bytes], slots: np.ndarray) -> int:
        """Store the snapshots in host state ``slots``, each after its page key; how many leading ones were stored."""
        if not len(page_keys):
            return 0
        with self.slots.batch(slots) as io:
            return self.store.set([state_key(key) for key in page_keys], io.pages)

    def close(self) -> None:
        """Wait for the I/O over the state host pool (the store stays open: it is the caller's)."""
        self.slots.close()
