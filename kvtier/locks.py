"""Every lock kvtier makes, made here: by role name, so the lock-order test mode can see them all.

Out of the test mode the factories return the plain lock (``threading.Lock``, ``RLock``, ``Condition`` or a
:class:`ForkSafeLock`): nothing but the call at creation. With ``KVTIER_LOCK_ORDER=1`` in the environment when
kvtier is imported, they return a :class:`~kvtier.lock_order.RecordingLock` over the same lock, which records which
locks each thread holds while it takes another and refuses an acquisition that inverts an order seen before
(:mod:`kvtier.lock_order`; the roles and their order are in docs/lifetime.md). The variable is read once, at import:
module-level locks are made then, and a lock must be recording from its first acquisition or not at all.

Fork: a server may fork a worker (multiprocessing's default on Linux) while another of its threads is inside kvtier:
the child gets a copy of every lock that thread held, held for good, and its first call that takes one hangs. What
the module-level locks guard stays consistent at any instant another thread can observe (each guarded step is one
dict or list operation, or a cache that may run one entry over its limit), so a child only needs them unheld: they
are ForkSafeLocks. A lock the forking thread itself holds stays held in the child, by that thread, as it is in the
parent: its ``with`` block ends there.
"""

from __future__ import annotations

import _thread
import os
import threading
import weakref
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.lock_order import RecordingLock

ENV_VAR = "KVTIER_LOCK_ORDER"
RECORDING = os.environ.get(ENV_VAR, "") == "1"
"""Whether locks made now record their order (``KVTIER_LOCK_ORDER=1`` when kvtier was imported)."""


class ForkSafeLock(_thread.RLock):  # type: ignore[misc]
    """A reentrant lock (``threading.RLock``, at its C speed) that a forked child gets unheld unless the forking
    thread held it. Make one with ``named_lock(name, fork_safe=True)``."""

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name
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


def named_lock(name: str, *, reentrant: bool = False, fork_safe: bool = False) -> Any:
    """A lock of role ``name`` (``"cache"``, ``"registration.spans"``): ``threading.Lock``, ``threading.RLock``
    (``reentrant``) or a :class:`ForkSafeLock` (``fork_safe``, reentrant too), recording in the test mode."""
    _check_name(name)
    if fork_safe:
        inner: Any = ForkSafeLock(name)
    else:
        inner = threading.RLock() if reentrant else threading.Lock()
    if not RECORDING:
        return inner
    return RecordingLock(inner, name, reentrant=reentrant or fork_safe)


def named_condition(name: str) -> threading.Condition:
    """A condition variable over a reentrant lock of role ``name`` (``threading.Condition()``'s own kind)."""
    _check_name(name)
    return threading.Condition(named_lock(name, reentrant=True)) if RECORDING else threading.Condition()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a lock needs a role name (a non-empty str), got {name!r}")


_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_locks):
        lock._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def held_here(lock: Any) -> bool:
    """Whether this thread holds the reentrant ``lock`` (made by :func:`named_lock` with ``reentrant=True``): the one
    place that asks a reentrant lock for its owner, which CPython's RLock answers through ``_is_owned``."""
    return bool(lock._is_owned())
