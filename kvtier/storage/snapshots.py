"""State snapshots in a store: the same store, read and written under the state snapshot format.

A hybrid cache keeps the state snapshots of its prefixes beside their KV pages, in the same store. A backend's
primitives (``_exists``, ``_get``, ``_set``, ``_delete``) move values through ``self.format``, ``self.page_bytes`` and
``self.namespace_id``; :func:`state_snapshots` returns a *view* of a backend: an instance of a subclass of the
backend's own class that shares the backend's instance dict (its connections, files, I/O threads, down/up state,
closing) and overrides only ``format`` (a :class:`~kvtier.storage.state_format.StateFormat`) and ``counters`` (the
store's own, under ``state.``). So every backend, the ones to come included, stores, reads and verifies snapshots
with the code it has for pages — one header check, one checksum, one degrade-to-miss path — and needs no code of its
own. Snapshots sit beside the pages, under keys of their own (:func:`kvtier.keys.state_key`).

What a backend keeps for this to hold (each backend here does): it reads the format only through ``self.format``
at call time (never a format, a page size or a bound method kept in an attribute), and keeps its state in the
instance dict (no ``__slots__``). A store that breaks this stores snapshots under the KV format, whose length check
turns every one of them into a miss: never a wrong byte.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.storage.backend import StorageBackend, StorageStats
from kvtier.storage.state_format import StateFormat

PREFIX = "state."


class PrefixedStats:
    """A store's counters seen from its snapshot view: counts go in under ``state.``, and the view's ``stats()``
    reads back only those."""

    def __init__(self, counters: StorageStats, prefix: str = PREFIX) -> None:
        self.counters, self.prefix = counters, prefix

    def add(self, name: str, value: float = 1) -> None:
        self.counters.add(self.prefix + name, value)

    def snapshot(self) -> dict[str, float]:
        return {name[len(self.prefix):]: value for name, value in self.counters.snapshot().items()
                if name.startswith(self.prefix)}


@functools.lru_cache(maxsize=64)
def _view_class(backend_class: type[StorageBackend], state_format: StateFormat) -> type[StorageBackend]:
    def body(namespace: dict[str, Any]) -> None:
        namespace["format"] = property(lambda self: state_format, doc="The state snapshot format.")
        namespace["counters"] = property(lambda self: PrefixedStats(self.__dict__["counters"]))
        namespace["__repr__"] = lambda self: f"{backend_class.__repr__(self)} (state snapshots)"
        namespace["snapshot_view"] = True
        namespace["__doc__"] = f"{backend_class.__name__} storing state snapshots (kvtier.storage.snapshots)."

    return types.new_class(f"{backend_class.__name__}Snapshots", (backend_class,), exec_body=body)


def state_snapshots(backend: StorageBackend, state_format: StateFormat) -> StorageBackend:
    """``backend`` storing state snapshots of ``state_format``: its calls (``present``, ``get``, ``set``,
    ``delete``, ``stats``) take snapshot keys and one slot's bytes per value. It lives as long as ``backend``: closing
    either closes the store."""
    if not isinstance(backend, StorageBackend) or backend.closed:
        raise InvalidArgument(f"state snapshots need an open StorageBackend, got {backend!r:.80}")
    if not isinstance(state_format, StateFormat):
        raise InvalidArgument(f"state_format={state_format!r:.80}: a kvtier.storage.state_format.StateFormat")
    if state_format.namespace_digest != backend.namespace.digest:
        raise InvalidArgument(f"the state format is of another namespace than {backend!r}")
    if getattr(type(backend), "snapshot_view", False):
        raise InvalidArgument(f"{backend!r} is a snapshot view already")
    view = object.__new__(_view_class(type(backend), state_format))
    view.__dict__ = backend.__dict__
    return view
