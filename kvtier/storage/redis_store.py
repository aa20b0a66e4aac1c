"""``RedisStore``: Redis or Valkey as the distributed engine, standalone or Redis Cluster, through redis-py.

One key per page, ``<prefix>:<namespace id>:p:<key hex>``, whose value is the stored page (header + payload: one
round trip reads and verifies it); the namespace's description lives at ``<prefix>:<namespace id>:namespace``,
rewritten with every batch of writes (a restart or an eviction loses it only until the next one).
Batches are pipelined, per cluster node. ``set`` writes each page's header and host pieces to the socket as they are
(no copy into one value). ``get`` reads the replies from the socket itself (:mod:`kvtier.storage.redis_reader`): each
page's header into a small buffer, checked, then its payload received straight into the host pieces, whatever the
host layout, and its checksum verified there on an I/O thread while the next pages come; a few pages are asked for
at a time, pages over 3 MiB in ``GETRANGE`` ranges (the server's side of a reply stays in its caches). Connections
that kvtier cannot read itself (RESP3, which the store's clients do not speak) go through redis-py's parser: one
``bytes`` per page, copied into the pieces once verified. ``direct_socket`` is the one place that decides.

URLs: ``redis://[user:password@]host:port/db``, ``rediss://…`` (TLS), ``unix:///path.sock``; a cluster with
``redis+cluster://host:port`` (or ``rediss+cluster://``, or ``cluster=True``): any node, the others are discovered,
keys spread over every slot. A URL and its query options are checked when the store opens
(:mod:`kvtier.storage.redis_url`). Memory bounds are the server's (``maxmemory`` with ``allkeys-lru``); ``ttl`` sets an
expiry per page. The client does not retry on its own: the store's down/up logic does (see
:mod:`kvtier.storage.backend`).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, cast

from redis.exceptions import AskError, ResponseError, TryAgainError

from kvtier.checks import positive_number
from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.locks import named_lock
from kvtier.storage.backend import Entry, StorageBackend, StorageError, scatter, settle
from kvtier.storage.format import PageRejected
from kvtier.storage.redis_reader import Read, ReadPlan, direct_socket, read_pages
from kvtier.storage.redis_url import parse_redis_url


class RedisStore(StorageBackend):
    kind = "redis"

    def __init__(self, url: str, namespace: Namespace | None, *, cluster: bool | None = None, prefix: str = "kvtier",
                 ttl: int | None = None, timeout: float | None = None, connect_timeout: float | None = None,
                 **options: Any) -> None:
        """``url`` and every option are checked here, before anything connects (:mod:`kvtier.storage.redis_url`);
        ``timeout`` / ``connect_timeout`` (default 5 s / 2 s) may come from the URL's ``socket_timeout`` /
        ``socket_connect_timeout`` instead, not from both."""
        super().__init__(namespace, **options)
        if not isinstance(url, str):
            raise InvalidArgument(f"Redis URL {url!r}: a string such as redis://host:6379/0")
        if cluster is not None and not isinstance(cluster, bool):
            raise InvalidArgument(f"cluster={cluster!r}: True, False or None (from the URL's scheme)")
        if ttl is not None and (type(ttl) is not int or ttl < 1):
            raise InvalidArgument(f"ttl={ttl!r}: whole seconds >= 1, or None")
        if not isinstance(prefix, str) or not prefix or ":" in prefix:
            raise InvalidArgument(f"prefix={prefix!r}: a non-empty name without ':'")
        target = parse_redis_url(url, cluster)
        connection = dict(target.options)
        for name, value, query, default in (("timeout", timeout, "socket_timeout", 5.0),
                                            ("connect_timeout", connect_timeout, "socket_connect_timeout", 2.0)):
            if value is not None and query in connection:
                raise InvalidArgument(f"{name}={value!r} and the URL's {query}: give it once")
            connection.setdefault(query, default if value is None else positive_number(value, name, unit="seconds"))
        self.cluster, self.url, self.where = target.cluster, target.url, target.where
        self.prefix, self.ttl = prefix, ttl
        self._options = connection
        self._client_lock = named_lock("storage.redis_client")
        self._client: Any = None
        self._record = json.dumps(self.describe()).encode() if namespace is not None else b""

    def __repr__(self) -> str:
        return f"RedisStore({'cluster ' if self.cluster else ''}{self.where}, namespace {self.namespace_id})"

    # -- the client ----------------------------------------------------------------------------------------------------
    def client(self) -> Any:
        """The redis-py client, made on first use (a cluster client connects when made: a server down at start-up
        is then an error of the first call, counted, not of the constructor)."""
        with self._client_lock:
            if self.closed:
                raise StorageError(f"{self!r} is closed")
            if self._client is None:
                from redis import Redis
                from redis.backoff import NoBackoff
                from redis.cluster import RedisCluster
                from redis.retry import Retry

                # RESP2: kvtier reads pages from the socket itself (redis_reader), and no push message comes between
                # replies (redis-py 8 speaks RESP3 unless told)
                options = {"retry": Retry(NoBackoff(), 0), "protocol": 2, **self._options}
                self._client = (RedisCluster if self.cluster else Redis).from_url(self.url, **options)
            return self._client

    def key(self, key: bytes) -> str:
        return f"{self.prefix}:{self.namespace_id}:p:{key.hex()}"

    def _each(self, keys: list[bytes], command: str,
              direct: Callable[[Any, list[int]], list[Any] | None] | None = None) -> list[Any]:
        """``command`` (a pipeline method taking one key name) for every key, one pipelined round trip per node (a
        cluster is asked node by node, each with the store's timeout: no cluster-wide retry loop); results in key
        order, error replies in place. ``direct(node client, indices)``: the node's results read another way, or
        None where that cannot be (then the pipeline reads them)."""
        results: list[Any] = [None] * len(keys)
        names = [self.key(k) for k in keys]
        owner, groups = self._by_node(names)        # held: a reset elsewhere must not close it under us
        for client, members in groups:
            found = direct(client, members) if direct is not None else None
            if found is None:
                pipe = client.pipeline(transaction=False)
                for i in members:
                    getattr(pipe, command)(names[i])
                found = pipe.execute(raise_on_error=False)
            for i, result in zip(members, found, strict=True):
                results[i] = result
        del owner
        return results

    def _pipeline(self) -> Any:
        client = self.client()
        return client.pipeline() if self.cluster else client.pipeline(transaction=False)

    # -- the backend ---------------------------------------------------------------------------------------------------
    def _exists(self, keys: list[bytes]) -> list[bool]:
        found = self._each(keys, "exists")
        for result in found:
            if isinstance(result, Exception):
                raise result
        return [bool(n) for n in found]

    def _get(self, keys: list[bytes], pages: list[list[memoryview]]) -> Iterator[PageRejected | None]:
        """The pages' values, node by node. Where the connection allows it (``direct_socket`` decides), read from
        its socket straight into the pages (``_read_into``): no copy but the kernel's, and each page's checksum is
        verified on an I/O thread while the next pages come. Else redis-py's pipeline of GETs (one round trip)
        parses each into one ``bytes``, verified and copied into the pages side by side on the I/O threads
        (xxhash and numpy drop the GIL)."""
        pool = self._io_pool() if self.io_threads > 1 and len(keys) > 1 else None
        checks: list[Future[Any] | None] = [None] * len(keys)

        def check(i: int, reply: Any) -> None:
            checks[i] = (self._submit(pool, self._verify_into, keys[i], pages[i], reply) if pool is not None
                         else _done(self._verify_into(keys[i], pages[i], reply)))

        try:
            replies = self._each(keys, "get", lambda client, members: self._read_into(
                client, [keys[i] for i in members], [pages[i] for i in members],
                lambda j, reply: check(members[j], reply)))
            for reply in replies:
                if isinstance(reply, Exception) and not isinstance(reply, PageRejected) and not _wrong_value(reply):
                    raise reply
            for i, reply in enumerate(replies):
                if checks[i] is None:                  # read through redis-py
                    check(i, reply)
        except BaseException:
            settle([c for c in checks if c is not None])           # no thread left in the pages
            raise
        return self._in_order(cast("list[Future[Any]]", checks))

    @functools.cached_property
    def _plan(self) -> ReadPlan:
        return ReadPlan(self.stored_bytes)

    def _read_into(self, client: Any, keys: list[bytes], pages: list[list[memoryview]],
                   read: Callable[[int, Any], None]) -> list[Any] | None:
        """The pages of ``keys`` read on one pooled connection of ``client`` straight into ``pages``
        (:func:`kvtier.storage.redis_reader.read_pages`, which calls ``read(index, reply)`` as each comes), or None
        where that connection cannot be read so; the replies in order."""
        replies: list[Any] = [None] * len(keys)

        def arrived(i: int, reply: Any) -> None:
            replies[i] = reply
            read(i, reply)

        with _pooled(client) as connection:
            sock = direct_socket(connection)
            if sock is None:
                return None
            read_pages(connection, sock, self._plan, self.format, [self.key(k).encode() for k in keys], keys, pages,
                       arrived)
        return replies

    def _verify_into(self, key: bytes, pieces: list[memoryview], blob: Any) -> PageRejected | None:
        if isinstance(blob, Read):                     # already in the pieces: the checksum over them, in place
            try:
                self.format.check_payload(blob.header, blob.checksum, pieces)
            except PageRejected as rejected:
                return rejected
            return None
        if isinstance(blob, PageRejected):
            return blob
        if blob is None:
            return PageRejected("absent", self.key(key))
        if isinstance(blob, Exception):                # e.g. WRONGTYPE: something else lives at the page's key
            return PageRejected("corrupt", f"{self.key(key)}: {blob}")
        try:
            payload = self.verify_blob(key, blob)
        except PageRejected as rejected:
            return rejected
        scatter(payload, pieces)
        return None

    def _set(self, keys: list[bytes], pages: list[list[memoryview]]) -> int:
        """SETs written straight to the connection: header and host pieces go to the socket as they are, with no
        copy into one value (redis-py's pipeline needs each value as one buffer). The namespace record rides in
        front of every batch (its node's share of it, on a cluster): a server restarted empty, a record evicted by
        ``allkeys-lru`` or deleted by hand is back with the next write, at the cost of a few hundred bytes and no
        round trip."""
        expiry = b"" if self.ttl is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(self.ttl)), self.ttl)
        words = b"*3\r\n" if self.ttl is None else b"*5\r\n"
        headers = [self.format.header(key, pieces) for key, pieces in zip(keys, pages, strict=True)]
        names = [self.record_key().encode(), *(self.key(k).encode() for k in keys)]
        owner, groups = self._by_node([n.decode() for n in names])
        for client, members in groups:
            chunks: list[Any] = []
            for i in members:
                if i == 0:
                    chunks.append(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                        len(names[0]), names[0], len(self._record), self._record))
                    continue
                length = len(headers[i - 1]) + sum(p.nbytes for p in pages[i - 1])
                chunks.append(b"%s$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (words, len(names[i]), names[i], length,
                                                                            headers[i - 1]))
                chunks.extend(pages[i - 1])
                chunks.append(b"\r\n" + expiry)
            _send(client, chunks, len(members))
        del owner
        return len(keys)

    def record_key(self) -> str:
        """Where the namespace's description lives."""
        return f"{self.prefix}:{self.namespace_id}:namespace"

    def _by_node(self, names: list[str]) -> tuple[Any, list[tuple[Any, list[int]]]]:
        """The client, and (client of the node holding them, indices into ``names``) per node: one for a standalone
        server."""
        client = self.client()
        if not self.cluster:
            return client, [(client, list(range(len(names))))]
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            node = client.get_node_from_key(name)
            groups.setdefault(node.name, (node.redis_connection, []))[1].append(i)
        return client, list(groups.values())

    def _delete(self, keys: list[bytes]) -> int:
        removed = self._each(keys, "delete")
        for result in removed:
            if isinstance(result, Exception):
                raise result
        return sum(removed)

    def _scan(self, pattern: str) -> Iterator[str]:
        for name in self.client().scan_iter(match=pattern, count=1000):
            yield name.decode() if isinstance(name, bytes) else name

    def _entries(self) -> Iterator[Entry]:
        names = list(self._scan(f"{self.prefix}:*:p:*"))
        for start in range(0, len(names), 512):
            batch = names[start:start + 512]
            pipe = self._pipeline()
            for name in batch:
                pipe.strlen(name)
            for name, size in zip(batch, pipe.execute(raise_on_error=False), strict=False):
                _, namespace, _, key = name.split(":", 3)
                if isinstance(size, int) and size:     # a key of another type is no page: clear() still removes it
                    yield Entry(namespace, key, size)

    def _namespaces(self) -> dict[str, dict[str, Any] | None]:
        found: dict[str, dict[str, Any] | None] = {}
        for name in self._scan(f"{self.prefix}:*:namespace"):
            raw = self.client().get(name)
            try:
                found[name.split(":")[1]] = json.loads(raw) if raw else None
            except ValueError:
                found[name.split(":")[1]] = None
        for entry in self._entries():
            found.setdefault(entry.namespace, None)
        return found

    def _remove(self, namespace_id: str | None) -> int:
        pattern = f"{self.prefix}:{namespace_id or '*'}:p:*"
        names = list(self._scan(pattern))
        removed = 0
        for start in range(0, len(names), 512):
            pipe = self._pipeline()
            for name in names[start:start + 512]:
                pipe.delete(name)
            removed += sum(pipe.execute())
        return removed

    def _reset(self, error: BaseException) -> None:
        """After a connection or cluster error, the next call gets a new client (a restarted server, a resharded
        cluster found afresh). The old one is not closed here: calls of other threads may still be using it; it
        closes when the last of them lets go. An error reply about one command (out of memory, say) changes
        nothing."""
        from redis.exceptions import ClusterError

        if isinstance(error, ResponseError) and not isinstance(error, (ClusterError, AskError, TryAgainError)):
            return
        with self._client_lock:
            self._client = None

    def _close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):     # nothing else to release
                client.close()


def _wrong_value(error: Exception) -> bool:
    """An error reply about the value at a key (a miss: WRONGTYPE), not about the cluster, the server or the
    connection (a failure). redis-py turns MOVED, ASK, CLUSTERDOWN, TRYAGAIN, NOPERM, READONLY into subclasses of
    ResponseError whose text drops the prefix, so the exact class is what tells."""
    return type(error) is ResponseError and str(error).startswith("WRONGTYPE")


def _done(result: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(result)
    return future


@contextlib.contextmanager
def _pooled(client: Any) -> Iterator[Any]:
    """One connection of ``client``'s pool, given back afterwards; disconnected first if anything was raised (its
    socket may hold the rest of a reply: it must never serve another call)."""
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        yield connection
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)


def _send(client: Any, chunks: list[Any], replies: int) -> None:
    """Write packed commands on one pooled connection and read their replies; the first error reply raises."""
    with _pooled(client) as connection:
        connection.send_packed_command(chunks)
        failed = None
        for _ in range(replies):
            try:
                connection.read_response()
            except ResponseError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
