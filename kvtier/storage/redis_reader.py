"""Pages read out of Redis replies with no copy of kvtier's: :class:`~kvtier.storage.redis_store.RedisStore` sends
the reads of a batch on one of redis-py's pooled connections and parses the RESP2 replies from its socket itself,
each payload received (``recv_into``) straight into the page's pieces in host memory: one copy per byte, the
kernel's, where redis-py makes a ``bytes`` of every reply and kvtier copied the page out of it.

What is asked, per page (:class:`ReadPlan`): ``GET`` for a page of up to ``PART_BYTES`` stored bytes; for a larger
one ``STRLEN`` and a ``GETRANGE`` per consecutive range of at most ``PART_BYTES``. And a few pages at a time, about
``WINDOW_BYTES`` of replies in flight (two pages at least), the next asked for as each one has been read. Both are
about the server, which copies a reply into its output buffers before it writes it: a batch of 32 ``GET``\\s sent at
once makes it build every reply (256 MiB for 8 MiB pages) before the first is read, long out of its caches; and a
reply of 8 MiB or more is an allocation that jemalloc (Redis's and Valkey's allocator) returns to the kernel when it
is freed, so each one page-faults afresh. On a 2-core VM (Redis 7.0, loopback): 2 MiB pages came at 1.1 GB/s with the
batch in flight, 2.2 GB/s with two pages; 8 MiB pages at 1.1 GB/s by ``GET``, 2.4 GB/s by ranges of 2.7 MiB.

A page's value is checked before anything is written to its pieces: the header (read into a small buffer) must be
this namespace's page of that key, and the value's length a page's; a value that is not is read past and dropped
(a miss, by the format's reason). The checksum is verified afterwards over the pieces in place (the store's I/O
threads), so a page whose bytes are damaged has been written to its buffers, and is reported rejected: the caller
treats it as a miss and its buffers as garbage, as the backend contract says of every page past the leading hits.

A socket error, a timeout, a connection closed in the middle of a reply, or a reply that is not what RESP2 answers
to these commands raises (redis-py's ConnectionError, TimeoutError or InvalidResponse): the store then disconnects
the connection, never giving it back to the pool with part of a reply unread.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.storage.format import HEADER_BYTES, PageFormat, PageRejected

PART_BYTES = 3 << 20
"""A page stored in more bytes than this is read in ranges of at most this many (below jemalloc's 8 MiB)."""
WINDOW_BYTES = 4 << 20
"""About how many bytes of replies are asked for ahead of the one being read (two pages at least)."""


class Read(NamedTuple):
    """A page whose header and length were checked and whose payload is in its pieces; its checksum is not verified
    yet (``header`` and ``checksum`` are what ``PageFormat.check_payload`` takes)."""

    header: bytes
    checksum: bytes


EMPTY = object()
"""``STRLEN`` said 0: the key is absent or holds an empty string (an ``EXISTS`` tells which)."""


def direct_socket(connection: Any) -> socket.socket | None:
    """The socket of a redis-py connection whose replies kvtier may read itself, or None where redis-py's parser
    must: the one place that decides. Only RESP2 (the store's clients speak it: on a RESP3 connection push messages
    may come between replies, and only redis-py hands them to their handlers). TCP, unix and TLS sockets alike:
    ``SSLSocket.recv_into`` decrypts into the buffer it is given."""
    sock = getattr(connection, "_sock", None)
    if str(getattr(connection, "protocol", "")) != "2" or not isinstance(sock, socket.socket):
        return None
    return sock


def command(*words: bytes) -> bytes:
    """One RESP command."""
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(word), word) for word in words)


class ReadPlan:
    """What is asked for the pages of one format (see the module's description)."""

    def __init__(self, stored_bytes: int) -> None:
        parts = -(-stored_bytes // PART_BYTES)
        step = -(-stored_bytes // parts)
        self.ranges = None if parts == 1 else [(start, min(start + step, stored_bytes))
                                               for start in range(0, stored_bytes, step)]
        self.window = max(2, -(-WINDOW_BYTES // stored_bytes))

    def commands(self, name: bytes) -> bytes:
        if self.ranges is None:
            return command(b"GET", name)
        return b"".join([command(b"STRLEN", name),
                         *(command(b"GETRANGE", name, b"%d" % start, b"%d" % (end - 1)) for start, end in self.ranges)])


def read_pages(connection: Any, sock: socket.socket, plan: ReadPlan, format: PageFormat, names: list[bytes],
               keys: list[bytes], pages: list[list[memoryview]], read: Callable[[int, Any], None]) -> None:
    """Read the pages of ``keys`` (stored at ``names``) into ``pages`` over ``connection``, calling ``read(index,
    outcome)`` as each page's outcome is known (so its checksum can be verified while the next pages come): a
    :class:`Read`, None (absent), a PageRejected (nothing of it was written to the pieces) or an error reply (a
    redis-py exception, not raised)."""
    requests = [plan.commands(name) for name in names]
    connection.send_packed_command([b"".join(requests[:plan.window])])
    replies = Replies(connection, sock)
    unsure = []
    for i, (key, pieces) in enumerate(zip(keys, pages, strict=True)):
        outcome = replies.page(key, pieces, format, plan.ranges)
        if i + plan.window < len(requests):
            connection.send_packed_command([requests[i + plan.window]], check_health=False)
        if outcome is EMPTY:
            unsure.append(i)
        else:
            read(i, outcome)
    if unsure:
        connection.send_packed_command([b"".join(command(b"EXISTS", names[i]) for i in unsure)], check_health=False)
        for i in unsure:
            read(i, replies.empty(keys[i], format))
    replies.done()


class Replies:
    """The replies on one connection's socket, parsed as they are needed. Lines (and a page's header, and the first
    bytes of its payload that came with them) go through a small buffer; the rest of a payload goes from the socket
    straight into the pieces. A value may come in several bulk strings (a page read in ranges): ``value`` reads
    across them."""

    SCRATCH = 1 << 16
    LINE_READ = 1024
    """Bytes asked of the socket when a line is wanted: the line, a page header and a little of the payload, which
    is copied from the buffer (the rest of a payload goes straight to its pieces)."""

    def __init__(self, connection: Any, sock: socket.socket) -> None:
        self.connection, self.sock = connection, sock
        self.buffer = bytearray(self.SCRATCH)
        self.view = memoryview(self.buffer)
        self.start = self.end = 0                      # bytes read from the socket and not used yet
        self.left: int | None = None                   # bytes left in the bulk string being read (None: none open)
        self.sizes: deque[int] = deque()               # the lengths of the value's bulk strings still to come

    # -- a page ----------------------------------------------------------------------------------------------------
    def page(self, key: bytes, pieces: list[memoryview], format: PageFormat,
             ranges: list[tuple[int, int]] | None) -> Any:
        """The next page's replies (one ``GET``'s, or ``STRLEN``'s and the ``GETRANGE``\\s' of ``ranges``)."""
        line = self.line()
        if line[:1] == b"-":
            self.sizes = deque([-1] * len(ranges or ()))   # the ranges' replies are errors too, or whatever: read past
            self.drop_rest()
            return self.connection._parser.parse_error(line[1:].decode(errors="replace"))
        if ranges is None:
            length = self.number(line, b"$")
            if length == -1:
                return None
            if length < 0:
                raise self.invalid("a negative length", line)
            self.left = length
        else:
            length = self.number(line, b":")
            self.sizes = deque(max(0, min(end, length) - start) for start, end in ranges)
            if length == 0:
                self.drop_rest()
                return EMPTY
        header = bytearray(min(length, HEADER_BYTES))
        try:
            self.value(memoryview(header))
            checksum = format.check_header(header, key)
            format.check_length(length - HEADER_BYTES)
            for piece in pieces:
                self.value(piece)
        except PageRejected as rejected:
            self.drop_rest()
            return rejected
        self.drop_rest()
        return Read(bytes(header), checksum)

    def empty(self, key: bytes, format: PageFormat) -> Any:
        """An ``EXISTS`` reply for a key whose ``STRLEN`` was 0: absent (None), or an empty value (rejected)."""
        line = self.line()
        if line[:1] == b"-":
            return self.connection._parser.parse_error(line[1:].decode(errors="replace"))
        if not self.number(line, b":"):
            return None
        try:
            format.check_header(b"", key)
        except PageRejected as rejected:
            return rejected
        raise AssertionError("an empty header passed its check")   # pragma: no cover

    def value(self, target: memoryview) -> None:
        """Fill ``target`` with the value's next bytes, across its bulk strings."""
        at = 0
        while at < target.nbytes:
            if not self.left:
                self.next_string()
            assert self.left is not None
            count = min(self.left, target.nbytes - at)
            self.into(target[at:at + count])
            self.left -= count
            at += count

    def next_string(self) -> None:
        """Open the value's next bulk string; one of another length than ``STRLEN`` promised means the value changed
        (or went) between the commands: a miss, nothing removed."""
        self.close_string()
        if not self.sizes:
            raise self.invalid("a value shorter than its length", b"")
        expected = self.sizes.popleft()
        line = self.line()
        got = -1 if line[:1] == b"-" else self.number(line, b"$")
        if got >= 0:
            self.left = got
        if got != expected:
            raise PageRejected("absent", f"the value changed while it was read ({line[:40]!r}, not {expected} "
                                         f"bytes)")

    def close_string(self) -> None:
        if self.left is not None:
            self.skip(self.left)
            if self.line():
                raise self.invalid("a bulk string longer than its length", b"")
            self.left = None

    def drop_rest(self) -> None:
        """Read past what is left of the value: the open bulk string and the replies still to come."""
        self.close_string()
        while self.sizes:
            self.sizes.popleft()
            line = self.line()
            if line[:1] != b"-":
                self.left = max(0, self.number(line, b"$"))
                self.close_string()

    # -- bytes -----------------------------------------------------------------------------------------------------
    def line(self) -> bytes:
        while True:
            at = self.buffer.find(b"\r\n", self.start, self.end)
            if at >= 0:
                line = bytes(self.view[self.start:at])
                self.start = at + 2
                return line
            if self.end - self.start > self.SCRATCH - self.LINE_READ:
                raise self.invalid("a line longer than any of these replies", bytes(self.view[self.start:self.end]))
            if self.end + self.LINE_READ > self.SCRATCH:        # room for the next read, at the front
                pending = self.end - self.start
                self.buffer[:pending] = self.view[self.start:self.end]
                self.start, self.end = 0, pending
            self.end += self.recv(self.view[self.end:self.end + self.LINE_READ])

    def number(self, line: bytes, kind: bytes) -> int:
        """The number of a ``$`` (bulk string length) or ``:`` (integer) line."""
        if line[:1] != kind:
            raise self.invalid(f"a reply of type {line[:1]!r} where {kind!r} belongs", line)
        try:
            return int(line[1:])
        except ValueError:
            raise self.invalid("a length that is not a number", line) from None

    def into(self, target: memoryview) -> None:
        """Fill ``target``: first with bytes already read, then from the socket."""
        at = min(self.end - self.start, target.nbytes)
        if at:
            target[:at] = self.view[self.start:self.start + at]
            self.start += at
        while at < target.nbytes:
            at += self.recv(target[at:])

    def skip(self, count: int) -> None:
        """Read ``count`` bytes and drop them."""
        used = min(self.end - self.start, count)
        self.start += used
        count -= used
        if count:
            self.start = self.end = 0
        while count:
            count -= self.recv(self.view[:min(count, self.SCRATCH)])

    def done(self) -> None:
        """Every reply was read: nothing may be left over (the connection goes back to the pool)."""
        if self.start != self.end:
            raise self.invalid("bytes after the last reply", bytes(self.view[self.start:self.end]))

    def recv(self, target: memoryview) -> int:
        try:
            count = self.sock.recv_into(target)
        except TimeoutError as exc:                    # socket.timeout: an OSError too, so first
            raise RedisTimeoutError(f"Timeout reading from {self.connection!r}") from exc
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from {self.connection!r}: {exc}") from exc
        if not count:
            raise RedisConnectionError(f"{self.connection!r} was closed by the server in the middle of a reply")
        return count

    def invalid(self, what: str, line: bytes) -> InvalidResponse:
        return InvalidResponse(f"{self.connection!r} sent {what} ({line[:40]!r}): kvtier reads RESP2 replies to "
                               f"GET, STRLEN, GETRANGE and EXISTS")
