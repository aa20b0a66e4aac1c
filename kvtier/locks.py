"""Locks a forked child can take.

A server may fork a worker (multiprocessing's default on Linux) while another of its threads is inside kvtier: the
child gets a copy of every lock that thread held, held for good, and its first call that takes one hangs. What these
locks guard stays consistent at any instant another thread can observe (each guarded step is one dict or list
operation, or a cache that may run one entry over its limit), so a child only needs them unheld. A lock the forking
thread itself holds stays held in the child, by that thread, as it is in the parent: its ``with`` block ends there.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType


class ForkSafeLock:
    """A ``threading.Lock`` (``threading.RLock`` with ``reentrant``) that a forked child gets unheld, unless the
    forking thread held it."""

    __slots__ = ("_lock", "_owner", "_reentrant", "__weakref__")

    def __init__(self, reentrant: bool = False) -> None:
        self._reentrant = reentrant
        self._lock = self._new()
        self._owner: int | None = None
        _locks.add(self)

    def _new(self) -> threading.Lock | threading.RLock:
        return threading.RLock() if self._reentrant else threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        taken = self._lock.acquire(blocking, timeout)
        if taken and not self._reentrant:
            self._owner = threading.get_ident()
        return taken

    def release(self) -> None:
        if not self._reentrant:
            self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        if self._reentrant:
            if not self._lock.acquire(blocking=False):
                return True
            self._lock.release()
            return bool(self._lock._is_owned())  # type: ignore[union-attr]
        return self._lock.locked()  # type: ignore[union-attr]

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()

    def _held_here(self) -> bool:
        """Whether this thread holds the lock (in a fork child: whether the forking thread did)."""
        if self._reentrant:
            return bool(self._lock._is_owned())  # type: ignore[union-attr]
        return self._owner == threading.get_ident() and self._lock.locked()  # type: ignore[union-attr]

    def _after_fork_in_child(self) -> None:
        if not self._held_here():
            self._lock, self._owner = self._new(), None


_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_locks):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
