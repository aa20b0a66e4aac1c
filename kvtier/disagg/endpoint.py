"""What a sender and a receiver share: closing once (a second closer waits for the first), and letting go of what
they hold in the order that keeps a peer from touching freed memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Endpoint:
    """Subclasses set ``_cond`` (a condition), ``_closing`` / ``_closed`` (False), ``_engine``, ``wire``, ``_staging``
    and ``pool``, and say in :meth:`_stopping` what must stop first."""

    _cond: Any
    _closing: bool
    _closed: bool
    _engine: Any
    _staging: Any
    wire: Any
    pool: Any

    def close(self) -> None:
        """Idempotent; a second closer waits for the first."""
        with self._cond:
            if self._closing:
                self._cond.wait_for(lambda: self._closed)
                return
            self._closing = True
            stop = self._stopping()
        try:
            stop()
            self._release()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _stopping(self) -> Callable[[], None]:
        """Under ``_cond``, as close begins: what must end first; returns what to do next, with no lock held."""
        raise NotImplementedError

    def _release(self) -> None:
        self._let_go()

    def _let_go(self) -> None:
        """Let go in order: the transfer engine (no copy runs after it), the Mooncake registrations (no peer reads or
        writes this memory after them), then the staging pool and this endpoint's place among its pool's users —
        those two even when an earlier step failed."""
        try:
            if self._engine is not None:
                self._engine.close()
            self.wire.unregister_all()
        finally:
            if self._staging is not None:
                self._staging.close()
            self.pool.remove_user(self)
