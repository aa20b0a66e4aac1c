"""An engine's lifetime: calls queue under one lock, and a close waits for the work queued so far, then lets go of
the pools and frees what the engine owns (docs/lifetime.md). A close asked for inside one of the engine's own calls
on this thread (a signal handler, a finalizer the collector ran there) waits until that call returns."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from kvtier.errors import BufferClosed, KvtierError, capture_refused
from kvtier.locks import held_here, named_lock
from kvtier.memory.lifetime import wait_then
from kvtier.pause_points import reached
from kvtier.runtime import Stream


class _EngineLock:
    """An engine's lock (reentrant). A close() asked for by the thread that holds it, in the middle of the engine's
    own call (a signal handler, a finalizer the collector ran there), must not free the streams and staging area that
    call is still queuing on: it is kept, and runs once that thread lets go of the lock."""

    def __init__(self) -> None:
        self._lock = named_lock("engine", reentrant=True)
        self._depth = 0
        self._after: list[Callable[[], None]] = []

    def held_here(self) -> bool:
        return held_here(self._lock)

    def after_call(self, close: Callable[[], None]) -> None:
        """Run ``close`` once this thread lets go of the lock (the caller holds it)."""
        self._after.append(close)

    def __enter__(self) -> _EngineLock:
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        after = self._after if not self._depth else []
        if after:
            self._after = []
        self._lock.release()
        for close in after:
            try:
                close()
            except KvtierError as error:
                if not capture_refused(error):
                    raise
                warnings.warn(f"a close asked for inside an engine call was refused as the call returned, a stream "
                              f"capturing ({error}): it stays open; close it once the capture ends", RuntimeWarning,
                              stacklevel=2)


class PoolUser:
    """What every engine over a device pool and a host pool shares: it is their user (closing either waits for its
    work), queues under one lock, and closes once — draining first, then letting go of the pools and freeing what it
    owns (``_release``). Subclasses say how to drain."""

    device_pool: Any
    host_pool: Any
    streams: dict[str, Stream]
    _captures: Any

    def _start(self, device_pool: Any, host_pool: Any) -> None:
        """First thing in ``__init__``."""
        self._lock = _EngineLock()
        self._closed = False
        self._closing = False
        self.device_pool, self.host_pool = device_pool, host_pool

    def _attach(self) -> None:
        """Last thing in ``__init__``, once nothing can fail: the pools now wait for this engine when they close."""
        self.device_pool.add_user(self)
        self.host_pool.add_user(self)

    @property
    def closed(self) -> bool:
        """Closed, or closing once the engine call this thread is inside returns."""
        return self._closed or self._closing

    def inside_call_here(self) -> bool:
        """Whether this thread is inside one of the engine's own calls (a signal handler or finalizer run there)."""
        return self._lock.held_here()

    def after_call(self, close: Callable[[], None]) -> None:
        """Run ``close`` (of the engine, or of a pool or captured load it is using) once the engine call this
        thread is inside returns: freeing what that call is still queuing on must wait for it."""
        self._lock.after_call(close)

    def synchronize(self) -> None:
        """Wait for everything queued so far (and every replay of a captured load)."""
        self.drain()

    def drain(self) -> None:
        """Wait for the engine's streams, captured loads and whatever else it queues on (``_drain_more``)."""
        with self._lock:
            if not self._closed:
                self._drain_streams()
                self._drain_more()

    def _drain_more(self) -> None:
        """Streams the engine uses beyond ``streams`` (a backend's, the layer signals')."""

    def _drain_streams(self) -> None:
        """Wait for the engine's own streams and captured loads (under the lock; nothing once closed)."""
        for stream in self.streams.values():
            stream.synchronize()
        for captured in list(self._captures):
            captured.drain()

    def _release(self) -> None:
        """Free what the engine owns (tables, rings, streams); everything queued has finished."""

    def close(self) -> None:
        """Wait for queued work, then free what the engine owns. Idempotent. Asked for in the middle of one of the
        engine's own calls on this thread, it happens as that call returns (no new call is taken meanwhile). Refused
        while a stream of the device captures (the wait is not allowed then): the engine stays open."""
        reached("engine.close")
        if self._lock.held_here() and not self._closed:
            if not self._closing:
                self._closing = True
                self._lock.after_call(self.close)
            return
        with self._lock:
            if self._closed:
                return
            wait_then(self.drain, self._finish_close, self._reopen)

    def _reopen(self) -> None:
        self._closing = False

    def _finish_close(self) -> None:
        self._closed = True
        self.device_pool.remove_user(self)
        self.host_pool.remove_user(self)
        self._release()

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise BufferClosed(f"this {type(self).__name__} is closed")
        self.device_pool.check_open()
        self.host_pool.check_open()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
