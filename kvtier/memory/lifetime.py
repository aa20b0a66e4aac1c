"""Who queues device work over a piece of memory, so that closing it first waits for that work.

A host pool freed while a DMA still reads it crashes the process; a device pool freed under a queued kernel lets the
kernel write into whatever reuses the memory. Engines register here as users of the memory they move; ``close()`` of
that memory drains every live user before giving the memory back, so closing never races a transfer: it waits.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from kvtier.errors import capture_refused

T = TypeVar("T")


class Drainable(Protocol):
    def drain(self) -> None:
        """Block until every operation this user queued has finished."""


def wait_then(wait: Callable[[], None], give_back: Callable[[], None], reopen: Callable[[], None]) -> None:
    """The one rule of a close: ``wait()`` for the work over what is closing, then ``give_back()``. A wait a capture
    refuses waited for nothing: ``reopen()`` and raise, so the caller can close again once the capture ends; after any
    other failure (a faulted device runs nothing more) give back all the same, then raise."""
    try:
        wait()
    except BaseException as error:
        if capture_refused(error):
            reopen()
            raise
        give_back()
        raise
    give_back()


class Users:
    def __init__(self) -> None:
        self._users: weakref.WeakSet[Drainable] = weakref.WeakSet()

    def add(self, user: Drainable) -> None:
        self._users.add(user)

    def discard(self, user: Drainable) -> None:
        self._users.discard(user)

    def drain(self) -> None:
        """Drain every user; the first error propagates after all were asked."""
        errors = []
        for user in list(self._users):
            try:
                user.drain()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def inside_here(self) -> Any:
        """A user this thread is inside a call of (a signal handler or finalizer run there), or None: closing what
        that call is still queuing on must wait until it returns (``user.after_call``)."""
        return next((user for user in list(self._users) if getattr(user, "inside_call_here", bool)()), None)

    def close(self, give_back: Callable[[], None], reopen: Callable[[], None]) -> None:
        """What closing the memory the users work on does after marking it closing: wait for every user, then
        ``give_back()``. Asked for on a thread inside one of a user's own calls (a signal handler or a finalizer run
        there), all of it runs as that call returns. A wait a capture refuses waited for nothing: ``reopen()``, and
        the refusal is raised; after any other failure the memory is given back all the same."""
        user = self.inside_here()
        if user is not None:
            user.after_call(lambda: wait_then(self.drain, give_back, reopen))
            return
        wait_then(self.drain, give_back, reopen)

    def __len__(self) -> int:
        return len(self._users)


class Owned:
    """Handles one object owns (buffers, tables, streams, events), closed last-first. Construction happens inside
    :meth:`building`, so a failure half-way closes what was already made instead of leaking it."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def own(self, handle: T) -> T:
        self._handles.append(handle)
        return handle

    @contextlib.contextmanager
    def building(self) -> Iterator[Owned]:
        try:
            yield self
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        while self._handles:
            self._handles.pop().close()
