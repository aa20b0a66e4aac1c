"""Locks a forked child can take.

A server may fork a worker (multiprocessing's default on Linux) while another of its threads is inside kvtier: the
child gets a copy of every lock that thread held, held for good, and its first call that takes one hangs. What these
locks guard stays consistent at any instant another thread can observe (each guarded step is one dict or list
operation, or a cache that may run one entry over its limit), so a child only needs them unheld. A lock the forking
thread itself holds stays held in the child, by that thread, as it is in the parent: its ``with`` block ends there.
"""

from __future__ import annotations

import _thread
import os
import weakref


class ForkSafeLock(_thread.RLock):  # type: ignore[misc]
    """A reentrant lock (``threading.RLock``, at its C speed) that a forked child gets unheld unless the forking
    thread held it."""

    def __init__(self) -> None:
        super().__init__()
        _locks.add(self)

    def locked(self) -> bool:
        """Whether any thread holds it."""
        if not self.acquire(blocking=False):
            return True
        self.release()
        return bool(self._is_owned())  # type: ignore[attr-defined]

    def _after_fork_in_child(self) -> None:
        if not self._is_owned():  # type: ignore[attr-defined]
            self._at_fork_reinit()  # type: ignore[attr-defined]


_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_locks):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
