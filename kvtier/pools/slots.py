"""Host page slots: which pages of a host pool are in use.

Contiguous runs are preferred because a run of host pages is one DMA for the ``direct`` and ``staged`` backends and
one storage read. Freeing checks every page first, so a double free or a foreign page changes nothing.
"""

from __future__ import annotations

import bisect

from kvtier.checks import index_array, integer
from kvtier.errors import KvtierError


class SlotError(KvtierError):
    """Double free, a page this allocator does not own, or not enough free pages."""


class PageSlotAllocator:
    def __init__(self, pages: int) -> None:
        self.pages = integer(pages, "pages", low=1)
        pages = self.pages
        self._runs: list[tuple[int, int]] = [(0, pages)]
        self._used: set[int] = set()

    @property
    def free_pages(self) -> int:
        return self.pages - len(self._used)

    def can_allocate(self, count: int) -> bool:
        return 0 <= integer(count, "count") <= self.free_pages

    def allocate(self, count: int) -> list[int]:
        """``count`` pages: one contiguous run when any fits (the smallest that does), else the fewest runs."""
        count = integer(count, "count", low=0)
        if not self.can_allocate(count):
            raise SlotError(f"cannot allocate {count} pages: {self.free_pages} of {self.pages} are free")
        fitting = [i for i, (_, length) in enumerate(self._runs) if length >= count]
        order = [min(fitting, key=lambda i: self._runs[i][1])] if fitting else sorted(
            range(len(self._runs)), key=lambda i: -self._runs[i][1])
        taken: list[int] = []
        for i in order:
            start, length = self._runs[i]
            take = min(length, count - len(taken))
            taken.extend(range(start, start + take))
            self._runs[i] = (start + take, length - take)
            if len(taken) == count:
                break
        self._runs = [run for run in self._runs if run[1]]
        self._used.update(taken)
        return taken

    def free(self, pages: list[int]) -> None:
        pages = index_array(pages, "pages").tolist()
        for page in pages:
            if not 0 <= page < self.pages:
                raise SlotError(f"page {page} does not belong to this allocator (0..{self.pages - 1})")
            if page not in self._used:
                raise SlotError(f"page {page} is not allocated (double free?)")
        if len(set(pages)) != len(pages):
            raise SlotError("the same page appears twice in one free()")
        self._used.difference_update(pages)
        for page in sorted(pages):
            self._insert(page)

    def _insert(self, page: int) -> None:
        starts = [start for start, _ in self._runs]
        i = bisect.bisect_left(starts, page)
        if i and self._runs[i - 1][0] + self._runs[i - 1][1] == page:
            start, length = self._runs[i - 1]
            self._runs[i - 1] = (start, length + 1)
            if i < len(self._runs) and self._runs[i][0] == page + 1:
                self._runs[i - 1] = (start, length + 1 + self._runs[i][1])
                del self._runs[i]
        elif i < len(self._runs) and self._runs[i][0] == page + 1:
            self._runs[i] = (page, self._runs[i][1] + 1)
        else:
            self._runs.insert(i, (page, 1))
