"""Locks a forked child can take.

A server may fork a worker (multiprocessing's default on Linux) while another of its threads is inside kvtier: the
child gets a copy of every lock that thread held, held for good, and its first call that takes one hangs. What these
locks guard stays consistent at any instant another thread can observe (each guarded step is one dict or list
operation, or a cache that may run one entry over its limit), so a child only needs them unheld.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType


class ForkSafeLock:
    """A ``threading.Lock`` that a forked child gets unheld."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _locks.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._lock.release()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_locks):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
