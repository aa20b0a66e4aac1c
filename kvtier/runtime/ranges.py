"""A sorted index of non-overlapping address ranges.

Both the runtime's record of host registrations and the emulator's per-device address maps are this: find the range
that holds an address, refuse a range that overlaps another.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Generic, Iterator, TypeVar

from kvtier.errors import InvalidArgument
from kvtier.pause_points import reached

T = TypeVar("T")


@dataclass
class Range(Generic[T]):
    start: int
    nbytes: int
    value: T
    aliases: dict[int, int] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def holds(self, address: int, nbytes: int = 1) -> bool:
        return self.start <= address and address + nbytes <= self.end


class RangeIndex(Generic[T]):
    """Readers take no lock: every add and pop builds new sorted tuples and publishes them in one assignment, so a
    lookup from another thread sees the index wholly before or wholly after a change, never a start without its range
    (writers still serialise among themselves, under their owner's lock)."""

    def __init__(self) -> None:
        self._index: tuple[tuple[int, ...], tuple[Range[T], ...]] = ((), ())
        self.generation = 0
        """Counts every add and pop: what was looked up at one generation still holds while it is unchanged."""

    def __len__(self) -> int:
        return len(self._index[1])

    def __iter__(self) -> Iterator[Range[T]]:
        return iter(self._index[1])

    @staticmethod
    def _before(starts: tuple[int, ...], ranges: tuple[Range[T], ...], end: int) -> Range[T] | None:
        """The last range starting below end."""
        i = bisect.bisect_left(starts, end)
        return ranges[i - 1] if i else None

    def overlapping(self, start: int, nbytes: int) -> Range[T] | None:
        last = self._before(*self._index, start + nbytes)
        return last if last is not None and last.end > start else None

    def add(self, start: int, nbytes: int, value: T) -> Range[T]:
        if nbytes <= 0:
            raise InvalidArgument(f"range size must be positive, got {nbytes}")
        clash = self.overlapping(start, nbytes)
        if clash is not None:
            raise InvalidArgument(f"[0x{start:x}, +{nbytes}) overlaps [0x{clash.start:x}, +{clash.nbytes})")
        starts, ranges = self._index
        i = bisect.bisect_left(starts, start)
        entry = Range(start, nbytes, value)
        self._index = (starts[:i] + (start,) + starts[i:], ranges[:i] + (entry,) + ranges[i:])
        self.generation += 1
        return entry

    def edges(self, start: int, end: int) -> list[int]:
        """Every range start and end strictly inside (start, end): where a copy spanning the interval would cross
        from one range to another."""
        starts, ranges = self._index
        i = bisect.bisect_right(starts, start)
        out = [] if not i or ranges[i - 1].end >= end or ranges[i - 1].end <= start else [ranges[i - 1].end]
        while i < len(ranges) and ranges[i].start < end:
            out.append(ranges[i].start)
            if ranges[i].end < end:
                out.append(ranges[i].end)
            i += 1
        return sorted(set(out))

    def at_or_below(self, address: int) -> Range[T] | None:
        """The range starting nearest below or at ``address``, holding it or not."""
        return self._before(*self._index, address + 1)

    def find(self, address: int, nbytes: int = 1) -> Range[T] | None:
        """The range holding all of [address, address + nbytes), or None."""
        last = self._before(*self._index, address + 1)
        return last if last is not None and last.holds(address, max(nbytes, 1)) else None

    def pop(self, start: int) -> Range[T]:
        starts, ranges = self._index
        i = bisect.bisect_left(starts, start)
        if i == len(starts) or starts[i] != start:
            raise KeyError(start)
        self._index = (starts[:i] + starts[i + 1:], ranges[:i] + ranges[i + 1:])
        reached("ranges.pop")
        self.generation += 1
        return ranges[i]
