"""The storage tier: pages that outlive the process and are shared between processes and machines.

Backends: ``FileStore`` (one file per page under a directory; the embedded default), ``RedisStore`` (Redis or
Valkey, standalone or Cluster: the distributed engine), ``MemoryStore`` (a dict, for tests). Every stored page
carries a verified header (:mod:`kvtier.storage.format`); every backend degrades to misses when its store fails
(:mod:`kvtier.storage.backend`). ``open_store(spec, namespace)`` builds one from a spec string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.errors import InvalidArgument
from kvtier.storage.backend import Entry, StorageBackend, StorageError, StorageStats
from kvtier.storage.file import FileStore
from kvtier.storage.format import HEADER_BYTES, PageFormat, PageRejected, describe_header
from kvtier.storage.memory import MemoryStore, SharedPages
from kvtier.storage.redis_store import RedisStore
from kvtier.storage.views import HostPages, PageIO

if TYPE_CHECKING:
    from kvtier.cache.keys import Namespace

SPEC_HELP = "file:PATH, redis://[user:pass@]host:port[/db], rediss://…, redis+cluster://host:port, or memory:"


def open_store(spec: str, namespace: Namespace | None, **options: Any) -> StorageBackend:
    """A backend from a spec: ``file:PATH`` (or a bare path), ``redis://…``, ``rediss://…``, ``unix://…``,
    ``redis+cluster://…``, ``memory:``. ``options`` go to the backend (``layout=`` the host layout of the pages
    given to it, default ``page_first``; ``max_bytes=``, ``fsync=``, ``ttl=``, ``timeout=``, ``retry_interval=``,
    ``batch_pages=``). ``namespace=None`` opens it for operators only."""
    if not isinstance(spec, str) or not spec:
        raise InvalidArgument(f"storage spec {spec!r}: expected {SPEC_HELP}")
    scheme = spec.split("://", 1)[0] if "://" in spec else ""
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        return RedisStore(spec, namespace, **options)
    if scheme:
        raise InvalidArgument(f"storage spec {spec!r}: unknown scheme {scheme!r}; expected {SPEC_HELP}")
    if spec.startswith("memory:"):
        if spec != "memory:":
            raise InvalidArgument(f"storage spec {spec!r}: memory: takes nothing after the colon")
        return MemoryStore(namespace, **options)
    path = spec[len("file:"):] if spec.startswith("file:") else spec
    if not path:
        raise InvalidArgument(f"storage spec {spec!r}: file: needs a directory, e.g. file:/var/cache/kvtier")
    return FileStore(path, namespace, **options)


__all__ = ["HEADER_BYTES", "SPEC_HELP", "Entry", "FileStore", "HostPages", "MemoryStore", "PageFormat", "PageIO",
           "PageRejected", "RedisStore", "SharedPages", "StorageBackend", "StorageError", "StorageStats",
           "describe_header", "open_store"]
