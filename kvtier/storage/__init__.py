"""The storage tier: pages that outlive the process and are shared between processes and machines.

Backends: ``FileStore`` (one file per page under a directory; the embedded default), ``RedisStore`` (Redis or
Valkey, standalone or Cluster), ``MooncakeStore`` (Mooncake Store: the distributed engine, zero-copy from registered
host pages), ``MemoryStore`` (a dict, for tests). Every stored page
carries a verified header (:mod:`kvtier.storage.format`); every backend degrades to misses when its store fails
(:mod:`kvtier.storage.backend`). ``open_store(spec, namespace)`` builds one from a spec string.
"""

from __future__ import annotations

import os
import re
from typing import Any

from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.storage.backend import Entry, StorageBackend, StorageError, StorageStats
from kvtier.storage.file import FileStore
from kvtier.storage.format import HEADER_BYTES, PageFormat, PageRejected, describe_header
from kvtier.storage.memory import MemoryStore, SharedPages
from kvtier.storage.mooncake import MooncakeStore
from kvtier.storage.mooncake_url import SCHEME as MOONCAKE_SCHEME
from kvtier.storage.redis_store import RedisStore
from kvtier.storage.redis_url import SCHEMES as REDIS_SCHEMES
from kvtier.storage.redis_url import shown
from kvtier.storage.snapshots import state_snapshots
from kvtier.storage.state_format import StateFormat
from kvtier.storage.views import HostPages, PageIO

SPEC_HELP = ("file:PATH, redis://[user:pass@]host:port[/db][?option=value…], rediss://…, unix:///path.sock, "
             "redis+cluster://host:port, mooncake://MASTER_HOST:PORT[?metadata=…&admin=…], or memory:")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def open_store(spec: str, namespace: Namespace | None, **options: Any) -> StorageBackend:
    """A backend from a spec: ``file:PATH`` (also ``file:///abs/path``, ``file:~/path``), ``redis://…``,
    ``rediss://…``, ``unix://…``, ``redis+cluster://…``, ``mooncake://…``, ``memory:``. ``options`` go to the
    backend (``layout=`` the host layout of the pages given to it, default ``page_first``; ``max_bytes=``,
    ``fsync=``, ``ttl=``, ``timeout=``, ``segment_bytes=``, ``retry_interval=``, ``batch_pages=``).
    ``namespace=None`` opens it for operators only.

    Everything is checked before anything is made or connected: a malformed spec, an unknown scheme (``x:y``), a
    bare path (write ``file:PATH``: a typo must not become a directory) or an option the backend does not take is
    InvalidArgument; a file store whose directory cannot be made is StorageError."""
    if not isinstance(spec, str) or not spec:
        raise InvalidArgument(f"storage spec {spec!r}: expected {SPEC_HELP}")
    said = shown(spec)                              # passwords masked in every message
    if spec != spec.strip():
        raise InvalidArgument(f"storage spec {said!r}: remove the spaces around it")
    if not spec.isprintable():
        raise InvalidArgument(f"storage spec {said!r} holds a control character")
    scheme = _SCHEME.match(spec)
    if scheme is None:
        raise InvalidArgument(f"storage spec {said!r} has no scheme: for a directory write file:{said}; "
                              f"expected {SPEC_HELP}")
    name = scheme.group()[:-1]
    if name in REDIS_SCHEMES:
        return RedisStore(spec, namespace, **_checked(RedisStore, said, options))
    if name == MOONCAKE_SCHEME:
        return MooncakeStore(spec, namespace, **_checked(MooncakeStore, said, options))
    if name == "memory":
        if spec != "memory:":
            raise InvalidArgument(f"storage spec {said!r}: memory: takes nothing after the colon")
        return MemoryStore(namespace, **_checked(MemoryStore, said, options))
    if name == "file":
        return FileStore(_file_path(spec), namespace, **_checked(FileStore, said, options))
    raise InvalidArgument(f"storage spec {said!r}: unknown scheme {name!r}; expected {SPEC_HELP}")


def _file_path(spec: str) -> str:
    path = spec[len("file:"):]
    if path.startswith("//"):                      # the URL form: file:///abs/path
        if path[2:] and not path.startswith("///"):
            raise InvalidArgument(f"storage spec {spec!r}: a file store is local; write file:///abs/path or "
                                  "file:PATH")
        path = path[2:]
    if not path:
        raise InvalidArgument(f"storage spec {spec!r}: file: needs a directory, e.g. file:/var/cache/kvtier")
    if "?" in path or "#" in path:
        raise InvalidArgument(f"storage spec {spec!r}: a file store takes its options as keywords of open_store "
                              "(max_bytes=, fsync=), not in the spec")
    return os.path.expanduser(path)


def _checked(backend: type[StorageBackend], spec: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options``, once every name is one ``backend`` takes (a misspelt option is not a TypeError)."""
    accepted = backend.option_names()
    for name in options:
        if name not in accepted:
            raise InvalidArgument(f"open_store({spec!r}): unknown option {name!r} for a {backend.kind} store; it "
                                  f"takes {', '.join(sorted(accepted))}")
    return options


__all__ = ["HEADER_BYTES", "SPEC_HELP", "Entry", "FileStore", "HostPages", "MemoryStore", "MooncakeStore", "PageFormat",
           "PageIO", "PageRejected", "RedisStore", "SharedPages", "StateFormat", "StorageBackend", "StorageError",
           "StorageStats", "describe_header", "open_store", "state_snapshots"]
