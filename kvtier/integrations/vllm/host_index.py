"""The scheduler's index of the host tier: which page keys the workers' host pools hold, in which page, and which of
them may be evicted.

vLLM's scheduler and its workers are different processes, so the scheduler decides everything by page number and
the workers only move bytes: every worker has a host pool of the same page count, and page ``p`` holds that rank's
shard of one page key on every rank. A page key is kvtier's chained SHA-256 (``kvtier.keys``): a key stands for its
whole prefix, so the longest cached prefix of a request is its leading keys found ``ready``.

An entry is ``writing`` from the moment the scheduler assigns a page to a save until every worker reports the save
done, ``reading`` while a storage read fills it; only ``ready`` entries match. Pinned entries (a load reads them, a
save or read fills them) are never evicted; eviction takes the least recently used unpinned ready entry with no
entry under it, so a kept chain never loses a page in its middle.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvtier.cache import PageAllocator

READY, WRITING, READING = "ready", "writing", "reading"


@dataclass
class Entry:
    page: int
    parent: bytes | None
    state: str
    pins: int = 0
    children: int = 0
    stale: bool = False
    """In use when the index was cleared: never matched again, dropped once no job uses it."""


class HostIndex:
    def __init__(self, pages: int) -> None:
        self.allocator = PageAllocator(pages, name="host pages")
        self.entries: dict[bytes, Entry] = {}
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self.evicted = 0

    @property
    def pages(self) -> int:
        return self.allocator.pages

    @property
    def evictable_pages(self) -> int:
        return len(self._evictable)

    def match(self, keys: list[bytes], start: int = 0) -> int:
        """How many of ``keys`` from ``start`` on are ready, in a run (touching them as recently used)."""
        count = 0
        for key in keys[start:]:
            entry = self.entries.get(key)
            if entry is None or entry.state != READY or entry.stale:
                break
            if key in self._evictable:
                self._evictable.move_to_end(key)
            count += 1
        return count

    def known(self, key: bytes) -> bool:
        """Held or being filled: a save of it would be a second copy."""
        return key in self.entries

    def pages_of(self, keys: list[bytes]) -> np.ndarray:
        return np.array([self.entries[key].page for key in keys], dtype=np.int64)

    def pin(self, keys: list[bytes]) -> None:
        for key in keys:
            entry = self.entries[key]
            entry.pins += 1
            self._evictable.pop(key, None)

    def unpin(self, keys: list[bytes]) -> None:
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                entry.pins -= 1
                self._consider(key, entry)

    def reserve(self, keys: list[bytes], parent: bytes | None, state: str) -> np.ndarray | None:
        """Pages for new entries of ``keys`` (a chain continuing ``parent``), pinned and ``state`` (writing or
        reading) until :meth:`commit` or :meth:`drop`; None, with nothing changed, when not enough pages can be
        freed."""
        pages = self.allocator.allocate(len(keys))
        if pages is None:
            self._evict(len(keys) - self.allocator.free_pages)
            pages = self.allocator.allocate(len(keys))
            if pages is None:
                return None
        for key, page in zip(keys, pages.tolist(), strict=True):
            up = parent if parent in self.entries else None
            self.entries[key] = Entry(int(page), up, state, pins=1)
            if up is not None:
                self._child(up, +1)
            parent = key
        return pages

    def commit(self, keys: list[bytes]) -> None:
        """The pages of ``keys`` hold their bytes on every worker: ready, and unpinned."""
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                entry.state = READY
        self.unpin(keys)

    def drop(self, keys: list[bytes]) -> None:
        """The pages of ``keys`` never got their bytes (a failed save or read): forget them, bottom-up, and give their
        pages back."""
        for key in reversed(keys):
            entry = self.entries.pop(key, None)
            if entry is None:
                continue
            self._evictable.pop(key, None)
            if entry.parent is not None and entry.parent in self.entries:
                self._child(entry.parent, -1)
            for child in (k for k, e in self.entries.items() if e.parent == key):
                self.entries[child].parent = None
            self.allocator.free(np.array([entry.page], dtype=np.int64))

    def _child(self, key: bytes, delta: int) -> None:
        entry = self.entries[key]
        entry.children += delta
        if delta > 0:
            self._evictable.pop(key, None)
        else:
            self._consider(key, entry)

    def _consider(self, key: bytes, entry: Entry) -> None:
        if entry.pins == 0 and entry.children == 0:
            if entry.stale:
                self.drop([key])
            elif entry.state == READY:
                self._evictable[key] = None

    def _evict(self, need: int) -> None:
        while need > 0 and self._evictable:
            key, _ = self._evictable.popitem(last=False)
            entry = self.entries.pop(key)
            self.allocator.free(np.array([entry.page], dtype=np.int64))
            self.evicted += 1
            need -= 1
            if entry.parent is not None and entry.parent in self.entries:
                self._child(entry.parent, -1)

    def clear(self) -> int:
        """Forget every entry (vLLM's reset_cache): the unused ones at once, those a job uses (and the chains under
        them) are never matched again and go when their jobs settle. Returns how many went at once."""
        before = len(self.entries)
        while self._evictable:
            self._evict(len(self._evictable))
        for entry in self.entries.values():
            entry.stale = True
        return before - len(self.entries)

    def check(self) -> None:
        """Invariants (tests): children counts, pins, evictable set, and the allocator agree with the entries."""
        counts: dict[bytes, int] = {}
        for entry in self.entries.values():
            if entry.parent is not None:
                assert entry.parent in self.entries, "an entry's parent is gone without its link cleared"
                counts[entry.parent] = counts.get(entry.parent, 0) + 1
        pages = [e.page for e in self.entries.values()]
        assert len(set(pages)) == len(pages), "two entries share a host page"
        assert self.allocator.used_pages == len(pages), "the allocator and the entries disagree on used pages"
        for key, entry in self.entries.items():
            assert entry.children == counts.get(key, 0), "a children count is wrong"
            assert entry.pins >= 0, "an entry is unpinned more often than pinned"
            evictable = entry.pins == 0 and entry.children == 0 and entry.state == READY and not entry.stale
            assert (key in self._evictable) == evictable, "the evictable set is wrong"
            assert not (entry.stale and entry.pins == 0 and entry.children == 0), "a stale entry outlived its jobs"
