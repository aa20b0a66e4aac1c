"""Page allocation for a tier of the cache, vectorised over page arrays.

The cache frees whole victims at once (a million tokens of eviction is a handful of numpy calls, not a Python loop per
page). With ``contiguous=True`` an allocation takes the smallest free run that fits, else the longest runs first:
a run of host pages is one DMA for the ``direct`` and ``staged`` backends and one storage read. Every free is checked
first (a page out of range, not allocated, or named twice), so a bad free changes nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.checks import index_array, integer
from kvtier.errors import InvalidArgument

try:
    from kvtier import _page_checks as _native
except ImportError:                               # not built (no C compiler at install)
    _native = None  # type: ignore[assignment]


class PageAllocator:
    def __init__(self, pages: int, *, name: str = "pages", contiguous: bool = False) -> None:
        self.pages = integer(pages, "pages", low=1)
        self.name, self.contiguous = name, contiguous
        self._used = np.zeros(self.pages, dtype=bool)
        self._free = np.arange(self.pages, dtype=np.int64)
        self._returned: list[np.ndarray] = []
        self._returned_count = 0

    @property
    def free_pages(self) -> int:
        return len(self._free) + self._returned_count

    @property
    def used_pages(self) -> int:
        return self.pages - self.free_pages

    def used_mask(self) -> np.ndarray:
        return self._used.copy()

    def is_used(self, pages: np.ndarray) -> np.ndarray:
        return self._used[pages]

    def allocate(self, count: int) -> np.ndarray | None:
        """``count`` pages, or None when fewer are free (the caller evicts and asks again)."""
        count = integer(count, "count", low=0)
        if count > self.free_pages:
            return None
        if self.contiguous and count:
            self._merge()
            taken = self._take_runs(count)
        else:
            taken = self._take_recent(count)
        self._used[taken] = True
        return taken

    def _take_recent(self, count: int) -> np.ndarray:
        """Most recently freed pages first, without sorting the free list (O(count), whatever the pool size)."""
        parts, need = [], count
        while need and self._returned:
            chunk = self._returned[-1]
            if len(chunk) <= need:
                parts.append(self._returned.pop())
            else:
                parts.append(chunk[len(chunk) - need:])
                self._returned[-1] = chunk[:len(chunk) - need]
            need -= len(parts[-1])
        self._returned_count -= count - need
        if need:
            parts.append(self._free[:need])
            self._free = self._free[need:]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts) if len(parts) != 1 else parts[0].copy()

    def release(self, pages: np.ndarray) -> None:
        """Free pages the caller's own bookkeeping vouches for (the cache's tree): no per-page checks."""
        self._used[pages] = False
        self._returned.append(pages)
        self._returned_count += pages.size

    def free(self, pages: Any) -> None:
        pages = index_array(pages, f"{self.name} pages")
        if not pages.size:
            return
        pages = pages.astype(np.int64, copy=False)
        outside = pages[(pages < 0) | (pages >= self.pages)]
        if outside.size:
            raise InvalidArgument(f"{self.name} page {int(outside[0])} is out of range (0..{self.pages - 1})")
        loose = pages[~self._used[pages]]
        if loose.size:
            raise InvalidArgument(f"{self.name} page {int(loose[0])} is not allocated (double free?)")
        if not distinct(pages):
            raise InvalidArgument(f"one free() names a {self.name} page twice")
        self._used[pages] = False
        self._returned.append(pages.copy())
        self._returned_count += pages.size

    def _merge(self) -> None:
        if self._returned:
            self._free = np.sort(np.concatenate([self._free, *self._returned]), kind="stable")
            self._returned, self._returned_count = [], 0

    def _take_runs(self, count: int) -> np.ndarray:
        free = self._free
        breaks = np.flatnonzero(np.diff(free) != 1) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [len(free)])))
        fitting = np.flatnonzero(lengths >= count)
        if fitting.size:
            best = fitting[np.argmin(lengths[fitting])]
            chosen = [(int(starts[best]), count)]
        else:
            chosen, left = [], count
            for run in np.argsort(-lengths, kind="stable"):
                take = min(int(lengths[run]), left)
                chosen.append((int(starts[run]), take))
                left -= take
                if not left:
                    break
        keep = np.ones(len(free), dtype=bool)
        for start, take in chosen:
            keep[start:start + take] = False
        taken = np.concatenate([free[start:start + take] for start, take in chosen])
        self._free = free[keep]
        return taken


def distinct(pages: np.ndarray) -> bool:
    """No page repeats; linear for the increasing runs allocations hand out, a sort otherwise."""
    if pages.size < 2 or bool((pages[1:] > pages[:-1]).all()):
        return True
    ordered = np.sort(pages)
    return bool((ordered[1:] != ordered[:-1]).all())


def take_pages(pages: np.ndarray, states: np.ndarray, want: int, to: int) -> bool:
    """In one C pass (``kvtier._page_checks``): when every page indexes ``states``, is in state ``want`` and is
    named once, move each to state ``to`` and say True. False changes nothing: some page is not so, or the pass
    could not run (not built, or not a contiguous int64 array); the caller then runs the numpy checks, which name
    the page and the fault."""
    if _native is None or pages.dtype != np.int64 or not pages.flags.c_contiguous:
        return False
    return _native.take(pages, states, want, to)
