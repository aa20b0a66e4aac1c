"""The lock-order test mode (``KVTIER_LOCK_ORDER=1``): every lock :mod:`kvtier.locks` makes records which locks its
thread already holds when it is taken, and an acquisition that would close a cycle is refused.

Two threads that take two locks in opposite orders deadlock only when their timing is unlucky, which a test run
almost never hits; but it does take both orders. So each acquisition adds the edges "held A while taking B" between
roles (lock names such as ``cache``, not instances) to one graph, and one whose edge closes a cycle raises
:class:`LockOrderError` before the lock is taken, recorded (``ORDER.inversions``) with the stacks where the opposite
path was first seen, for code that swallows the error. Reentrant re-takes and try-locks make no edge; two instances
of one role are ordered instance by instance; a ``Condition.wait``'s re-take is checked but only recorded. Edges a
finalizer takes inside a garbage collection depend on where the collection started, so a cycle that needs one is
recorded apart (``ORDER.collector_cycles``) and not refused. docs/lifetime.md has the roles and their order.
"""

from __future__ import annotations

import _thread
import gc
import itertools
import os
import threading
import traceback
import weakref
from dataclasses import dataclass
from typing import Any

STACK_FRAMES = 16
"""Frames kept of the stack where an edge was first seen."""


class LockOrderError(RuntimeError):
    """Two locks taken in both orders (or a plain lock taken twice by one thread): a deadlock waiting for its timing.
    Not a KvtierError, so that kvtier's own handlers of those do not swallow it."""


@dataclass(frozen=True)
class Edge:
    """Lock ``held`` was held while ``taken`` was taken, first by ``thread`` at ``stack`` (``collector``: by a
    finalizer the garbage collector ran)."""

    held: str
    taken: str
    thread: str
    stack: str
    collector: bool = False


@dataclass(frozen=True)
class Inversion:
    """Taking ``taken`` while holding ``held`` (``edge``), against the earlier ``opposite`` path from ``taken`` back
    to ``held``."""

    edge: Edge
    opposite: tuple[Edge, ...]

    def __str__(self) -> str:
        new = self.edge
        path = " -> ".join([self.opposite[0].held, *(edge.taken for edge in self.opposite)])
        seen = "".join(f"  {edge.held} held while taking {edge.taken}{_by(edge)}, first in thread {edge.thread}:\n"
                       f"{_indent(edge.stack)}" for edge in self.opposite)
        return (f"lock order inversion: {new.taken!r} taken while holding {new.held!r}{_by(new)}, but the "
                f"opposite order {path} was seen before:\n{seen}  now, in thread {new.thread}:\n{_indent(new.stack)}")


def _by(edge: Edge) -> str:
    return " (by a finalizer the garbage collector ran)" if edge.collector else ""


def _indent(stack: str) -> str:
    return "".join(f"    {line}\n" for line in stack.rstrip().splitlines())


def _stack() -> str:
    frames = [frame for frame in traceback.extract_stack() if frame.filename != __file__]
    return "".join(traceback.format_list(frames[-STACK_FRAMES:]))


class _Graph:
    """Edges by key (two role names, or two instance serials of one role), and each role's following roles."""

    def __init__(self) -> None:
        self.edges: dict[tuple[Any, Any], Edge] = {}
        self._following: dict[str, list[str]] = {}

    def keep(self, key: tuple[Any, Any], edge: Edge) -> None:
        if key not in self.edges:
            self.edges[key] = edge
            if isinstance(key[0], str):
                self._following.setdefault(key[0], []).append(key[1])

    def path_back(self, key: tuple[Any, Any]) -> tuple[Edge, ...] | None:
        """The edges of a path from ``key[1]`` back to ``key[0]`` (between two instances of one role: that pair the
        other way round), or None."""
        held, taken = key
        if isinstance(held, int):
            earlier = self.edges.get((taken, held))
            return None if earlier is None else (earlier,)
        parents: dict[str, str] = {taken: taken}
        frontier = [taken]
        while frontier and held not in parents:
            node = frontier.pop()
            for after in self._following.get(node, ()):
                if after not in parents:
                    parents[after] = node
                    frontier.append(after)
        if held not in parents:
            return None
        path, node = [], held
        while node != taken:
            path.append(self.edges[(parents[node], node)])
            node = parents[node]
        return tuple(reversed(path))


_orders: weakref.WeakSet[LockOrder] = weakref.WeakSet()


class LockOrder:
    """The graph of roles ("held A while taking B"), the order between instances of one role, and what closed a
    cycle in them."""

    def __init__(self) -> None:
        self._mutex = _thread.allocate_lock()
        self._regular = _Graph()
        """Edges taken outside the garbage collector."""
        self._any = _Graph()
        """Every edge, the collector's too."""
        self._reported: set[tuple[Any, Any, bool]] = set()
        self.inversions: list[Inversion] = []
        """Cycles of edges taken outside the collector: refused where they were closed, and a failed test run."""
        self.collector_cycles: list[Inversion] = []
        """Cycles that need an edge a finalizer took inside a garbage collection: recorded, not refused."""
        _orders.add(self)

    def edges(self) -> list[Edge]:
        """Every edge seen so far, the first sighting of each outside the collector where there was one."""
        with self._mutex:
            return [self._regular.edges.get(key, edge) for key, edge in self._any.edges.items()]

    def check(self, held: list[RecordingLock], taking: RecordingLock, *, refuse: bool = True) -> None:
        """Add the edges from every lock in ``held`` to ``taking``; raise LockOrderError (``refuse``) when one closes a
        cycle of edges taken outside the collector. A known edge costs a dict lookup: only a new one takes the mutex
        and walks the graph."""
        known = self._regular.edges
        for lock in held:
            key = (lock.serial, taking.serial) if lock.name == taking.name else (lock.name, taking.name)
            if key not in known:
                collector = _collecting == _thread.get_ident()
                if not (collector and key in self._any.edges):
                    edge = Edge(lock.name, taking.name, threading.current_thread().name, _stack(), collector)
                    self._add(key, edge, refuse)

    def _add(self, key: tuple[Any, Any], edge: Edge, refuse: bool) -> None:
        found = None
        with self._mutex:
            regular = None if edge.collector else self._regular.path_back(key)
            if regular is None:
                found = self._any.path_back(key)   # through an edge only the collector took, if any
                self._any.keep(key, edge)
                if not edge.collector:
                    self._regular.keep(key, edge)
                if found is None:
                    return
            cycles = self.collector_cycles if regular is None else self.inversions
            inversion = Inversion(edge, regular or found or ())
            if (*key, regular is None) not in self._reported:
                self._reported.add((*key, regular is None))
                cycles.append(inversion)
        if regular is not None and refuse:
            raise LockOrderError(str(inversion))

    def _after_fork_in_child(self) -> None:
        self._mutex = _thread.allocate_lock()


ORDER = LockOrder()
"""The graph every lock of :func:`kvtier.locks.named_lock` records into."""

_serials = itertools.count(1)
_local = threading.local()
_collecting: int | None = None
"""The thread inside a garbage collection (its finalizers and end-of-collection callbacks), if any: CPython runs
one collection at a time."""


def _phase(phase: str, info: dict) -> None:
    global _collecting
    _collecting = threading.get_ident() if phase == "start" else None


def _held() -> list[RecordingLock]:
    try:
        return _local.held
    except AttributeError:
        _local.held = []
        return _local.held


def _forget(held: list[RecordingLock], lock: RecordingLock) -> None:
    """Drop ``lock``'s last entry (a lock let go of out of order)."""
    for at in range(len(held) - 1, -1, -1):
        if held[at] is lock:
            del held[at]
            break


class RecordingLock:
    """A lock (``threading.Lock``, ``RLock`` or a ForkSafeLock) that keeps its thread's list of held locks and the
    order graph up to date. Usable as a Condition's lock (over a reentrant one); anything else is the inner lock's."""

    __slots__ = ("_inner", "name", "serial", "reentrant", "order", "__weakref__")

    def __init__(self, inner: Any, name: str, *, reentrant: bool, order: LockOrder | None = None) -> None:
        self._inner, self.name, self.reentrant = inner, name, reentrant
        self.serial = next(_serials)
        self.order = order or ORDER
        if _phase not in gc.callbacks:
            gc.callbacks.append(_phase)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        try:
            held = _local.held
        except AttributeError:
            held = _local.held = []
        if held:
            if self in held:
                if not self.reentrant and blocking:
                    raise LockOrderError(f"the plain (not reentrant) lock {self.name!r} taken again by the thread "
                                         f"that holds it: it would wait for itself forever\n{_indent(_stack())}")
            elif blocking:
                self.order.check(held, self)
        if self._inner.acquire(blocking, timeout):
            held.append(self)
            return True
        return False

    __enter__ = acquire

    def release(self, *exc: object) -> None:
        """Also ``__exit__`` (which passes the exception, ignored): one call per ``with`` block."""
        self._inner.release()
        try:
            held = _local.held
        except AttributeError:   # a thread that took none: nothing of its own to forget
            return
        if held and held[-1] is self:
            held.pop()
        else:
            _forget(held, self)

    __exit__ = release

    def _is_owned(self) -> bool:
        return bool(self._inner._is_owned())

    def _release_save(self) -> tuple[Any, int]:
        """Condition.wait: let go of every level this thread holds."""
        state = self._inner._release_save()
        held = _held()
        count = held.count(self)
        held[:] = [lock for lock in held if lock is not self]
        return state, count

    def _acquire_restore(self, saved: tuple[Any, int]) -> None:
        held = _held()
        if held:
            self.order.check(held, self, refuse=False)
        self._inner._acquire_restore(saved[0])
        held.extend([self] * saved[1])

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._inner, attribute)

    def __repr__(self) -> str:
        return f"<RecordingLock {self.name!r} #{self.serial} over {self._inner!r}>"


def _after_fork_in_child() -> None:
    for order in list(_orders):
        order._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
