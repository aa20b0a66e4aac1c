"""A process-wide count of memory closings: every buffer release and every pool close adds one.

``KVCache`` refuses every call once a pool under it is closed, and asking each pool (and each buffer under it) costs
a walk of properties on every match and insert, ~5 µs with the caches cold. It asks them only when this count moved
since its last full check. A closer marks itself closed *before* it counts, so whoever reads a moved count finds
the closed state; two closers that race on the count still move it (neither write restores an older value)."""

from __future__ import annotations

_count = 0


def counted() -> None:
    """One more closing (call after marking the closed state)."""
    global _count
    _count += 1


def count() -> int:
    return _count
