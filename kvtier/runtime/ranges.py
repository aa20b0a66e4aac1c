"""A sorted index of non-overlapping address ranges.

Both the runtime's record of host registrations and the emulator's per-device address maps are this: find the range
that holds an address, refuse a range that overlaps another.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Generic, Iterator, TypeVar

from kvtier.errors import InvalidArgument

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
    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ranges: list[Range[T]] = []
        self.generation = 0
        """Counts every add and pop: what was looked up at one generation still holds while it is unchanged."""

    def __len__(self) -> int:
        return len(self._ranges)

    def __iter__(self) -> Iterator[Range[T]]:
        return iter(list(self._ranges))

    def overlapping(self, start: int, nbytes: int) -> Range[T] | None:
        i = bisect.bisect_left(self._starts, start + nbytes)
        if i and self._ranges[i - 1].end > start:
            return self._ranges[i - 1]
        return None

    def add(self, start: int, nbytes: int, value: T) -> Range[T]:
        if nbytes <= 0:
            raise InvalidArgument(f"range size must be positive, got {nbytes}")
        clash = self.overlapping(start, nbytes)
        if clash is not None:
            raise InvalidArgument(f"[0x{start:x}, +{nbytes}) overlaps [0x{clash.start:x}, +{clash.nbytes})")
        i = bisect.bisect_left(self._starts, start)
        entry = Range(start, nbytes, value)
        self._starts.insert(i, start)
        self._ranges.insert(i, entry)
        self.generation += 1
        return entry

    def edges(self, start: int, end: int) -> list[int]:
        """Every range start and end strictly inside (start, end): where a copy spanning the interval would cross
        from one range to another."""
        i = bisect.bisect_right(self._starts, start)
        out = [] if not i or self._ranges[i - 1].end >= end or self._ranges[i - 1].end <= start else \
            [self._ranges[i - 1].end]
        while i < len(self._ranges) and self._ranges[i].start < end:
            out.append(self._ranges[i].start)
            if self._ranges[i].end < end:
                out.append(self._ranges[i].end)
            i += 1
        return sorted(set(out))

    def find(self, address: int, nbytes: int = 1) -> Range[T] | None:
        """The range holding all of [address, address + nbytes), or None."""
        i = bisect.bisect_right(self._starts, address)
        if i and self._ranges[i - 1].holds(address, max(nbytes, 1)):
            return self._ranges[i - 1]
        return None

    def pop(self, start: int) -> Range[T]:
        i = bisect.bisect_left(self._starts, start)
        if i == len(self._starts) or self._starts[i] != start:
            raise KeyError(start)
        del self._starts[i]
        self.generation += 1
        return self._ranges.pop(i)
