"""CPU-domain views of host pages: what storage backends read into and write from.

Storage is a CPU-side consumer: it gets each page as the list of its contiguous pieces in host memory, built from
``HostPool.page_metadata`` (CPU addresses, never a device alias). A page of a ``page_first``, ``page_first_direct``
or ``page_head`` pool is one piece per tensor (K and V for MHA, one for MLA); a ``layer_first`` page is one piece per
tensor and layer. Backends take the pieces as they are: the file store with vectored I/O (``preadv``/``pwritev``),
the Redis store by writing them to the socket one after the other, so no layout needs a bounce buffer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.address import CpuAddress
from kvtier.errors import BufferClosed
from kvtier.locks import named_condition
from kvtier.pools import HostPool
from kvtier.pools.state import StateHostPool
from kvtier.storage.backend import StorageBackend

Pieces = list[memoryview]


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


class PageIO:
    """The pieces of some host pages, for one batch of storage I/O over an open pool. Built inside
    :meth:`HostPages.batch`, which keeps the pool from closing until the batch is done."""

    def __init__(self, pool: HostPool | StateHostPool, pages: Sequence[int] | np.ndarray) -> None:
        """Slices of one view of the pool's CPU mapping at the offsets ``page_pieces`` gives (the CPU-domain twin of
        ``page_metadata``; a ctypes view per piece cost 0.3 ms a page for ``layer_first`` pools)."""
        self.pool = pool
        offsets, sizes = pool.page_pieces(pages)
        whole = _view(pool.buffer.cpu_address.value, pool.buffer.nbytes)
        sizes_list = sizes.tolist()
        self.pages = [[whole[offset:offset + size] for offset, size in zip(row, sizes_list, strict=True)]
                      for row in offsets.tolist()]

    def __len__(self) -> int:
        return len(self.pages)

    def pieces(self, index: int) -> Pieces:
        return self.pages[index]


class HostPages:
    """A host pool as seen by storage I/O: batches register as users of the pool, so closing the pool waits for
    the I/O in flight instead of unmapping memory a read is writing into. A state host pool's slots are its pages
    (one piece each: a hybrid model's snapshots)."""

    def __init__(self, pool: HostPool | StateHostPool, store: StorageBackend | None = None) -> None:
        """``store``: the backend these pages move to and from; the pool's memory is registered with it (by CPU
        address) for as long as this lives, so a store with its own transfer engine moves pages with no copy."""
        self.pool, self.store = pool, store
        self._cond = named_condition("storage.pages")
        self._inflight = 0
        self._registered: CpuAddress | None = None
        pool.add_user(self)
        if store is not None:
            address = pool.buffer.cpu_address
            try:
                store.register_memory(address, pool.buffer.nbytes)
            except BaseException:
                pool.remove_user(self)
                raise
            self._registered = address

    def batch(self, pages: Sequence[int] | np.ndarray) -> _Batch:
        return _Batch(self, pages)

    def drain(self) -> None:
        """Wait for the batches in flight. The pool's buffer calls this when it closes, before its memory goes: so
        the memory is unregistered from the store here too (once), never left registered after it is freed."""
        with self._cond:
            self._cond.wait_for(lambda: self._inflight == 0)
            address, self._registered = self._registered, None
        if address is not None and self.store is not None and not self.store.closed:
            self.store.unregister_memory(address)

    def close(self) -> None:
        self.drain()
        if not self.pool.closed:
            self.pool.remove_user(self)

    def _enter(self) -> None:
        with self._cond:
            self._inflight += 1

    def _exit(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()


class _Batch:
    def __init__(self, owner: HostPages, pages: Any) -> None:
        self.owner, self.pages = owner, pages

    def __enter__(self) -> PageIO:
        self.owner._enter()
        try:
            if self.owner.pool.closed:
                raise BufferClosed(f"{self.owner.pool!r} is closed")
            self.owner.pool.check_open()
            return PageIO(self.owner.pool, self.pages)
        except BaseException:
            self.owner._exit()
            raise

    def __exit__(self, *exc: object) -> None:
        self.owner._exit()
