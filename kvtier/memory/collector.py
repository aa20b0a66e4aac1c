"""Closing host buffers from finalizers while the garbage collector runs.

An engine's cleanup (``weakref.finalize(engine, pool.close)``) can run in the middle of the very collection that is
about to free the buffer's last tensor views. The collector cannot be asked to finish early, so such a close is
kept and tried again when a collection ends, until no view is left (or the buffer is gone). Nothing here raises:
a gc callback that raised would be reported as unraisable and stop the other retries.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Protocol


class Closable(Protocol):
    @property
    def closed(self) -> bool: ...

    def live_views(self) -> int: ...

    def close(self) -> None: ...


class Collector:
    def __init__(self) -> None:
        self.thread: int | None = None
        self.pending: list[weakref.ref[Closable]] = []
        # first: the lock-order mode's callback, which marks a collection's end, then counts the closes retried at
        # the end as the collector's (kvtier.lock_order)
        gc.callbacks.insert(0, self.phase)

    def running_here(self) -> bool:
        """Whether this thread is inside a collection (finalizers run there; ``gc.collect()`` would do nothing)."""
        return self.thread == threading.get_ident()

    def close_later(self, buffer: Closable) -> None:
        if not any(ref() is buffer for ref in self.pending):
            self.pending.append(weakref.ref(buffer))

    def after_fork(self) -> None:
        self.thread, self.pending = None, []

    def phase(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.thread = threading.get_ident()
            return
        self.thread = None
        pending, self.pending = self.pending, []
        for ref in pending:
            buffer = ref()
            if buffer is None or buffer.closed:
                continue
            try:
                if buffer.live_views() == 0:
                    buffer.close()
            except Exception:  # noqa: BLE001 (see the module docstring)
                pass
            if not buffer.closed:
                self.close_later(buffer)


COLLECTOR = Collector()
