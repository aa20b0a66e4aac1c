"""A process-wide count of memory closings: every buffer release and every pool close adds one.

``KVCache`` refuses every call once a pool under it is closed, and asking each pool (and each buffer under it) costs
a walk of properties on every match and insert, ~5 µs with the caches cold. It asks them only when this count moved
since its last full check. A closer marks itself closed *before* it counts, so whoever reads a moved count finds
the closed state. The count only grows: the increment holds a lock (reentrant, as a garbage collector's finalizer
may close a buffer inside another closing's increment on the same thread; fork-safe, as a close may run in a child),
so no closer can write back a value older than one a reader already saw."""

from __future__ import annotations

from kvtier.locks import named_lock

_lock = named_lock("closings", fork_safe=True)
_count = 0


def counted() -> None:
    """One more closing (call after marking the closed state)."""
    global _count
    with _lock:
        _count += 1


def count() -> int:
    return _count
