"""``MooncakeStore``: Mooncake Store as the distributed storage tier, zero-copy from and into registered host pages.

Mooncake keeps objects in memory that its clients lend it (segments), across machines, and moves them with its
transfer engine (TCP, or RDMA straight from and into registered memory). A page is one object,
``<prefix>:<namespace id>:p:<key hex>``, assembled from several buffers: its 132-byte header (from a small
registered scratch block) and the page's pieces in the host pool, so ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` move it with no intermediate ``bytes`` and no copy, whatever the host layout. The
header and checksum are checked on every read, as for every store.

- **Registration.** Memory handed to Mooncake must be registered with it, by CPU address (never a device alias):
  the cache registers its host pool once (:meth:`register_memory`, through ``HostPages``) and unregisters it at
  close. A buffer outside registered memory (a caller's numpy array) goes through a registered bounce block: one
  copy, counted as ``bounced_pages``.
- **Return codes, not exceptions.** Mooncake answers per key. An object that is not there (``-704``), not ready
  (``-703``) or whose lease ran out mid-read (``-707``) is a miss (``absent``); a size other than a page's is a
  miss that removes it; an RPC or transfer failure (the master or a segment holder gone) raises, so the base counts
  an error, returns misses, and leaves the store down for ``retry_interval``. A store that drops objects it
  acknowledged (eviction, a segment holder that left, a restarted master) is normal: its pages read as misses.
- **Never wait 90 seconds.** A Mooncake client asked to reach a master that is not there retries for about 90
  seconds; so the store connects lazily, and only after a TCP probe of the master (and an HTTP metadata server)
  answers within ``connect_timeout``; while down, each retry probes first.
- **Fork.** A Mooncake client does not survive fork: in a child of a process that set one up, a new client hangs
  in its setup and the old one crashes. The store's calls there are counted errors (misses), never a hang: a worker
  process that needs the store is started with ``spawn``.
- **Memory bounds and eviction are the store's:** the memory the segment holders lend (``mooncake_client
  --global_segment_size``, or ``segment_bytes`` here) bounds it; the master evicts past
  ``--eviction_high_watermark_ratio`` (0.9) of it, ``--eviction_ratio`` (5%) at a time, objects whose lease
  (``--default_kv_lease_ttl``, 10 s after a read) has ended.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import json
import os
import re
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from kvtier.address import CpuAddress
from kvtier.checks import integer, positive_number
from kvtier.errors import InvalidArgument
from kvtier.keys import Namespace
from kvtier.locks import named_condition, named_lock
from kvtier.storage.backend import Entry, PartialWrite, StorageBackend, StorageError
from kvtier.storage.format import HEADER_BYTES, PageRejected
from kvtier.storage.mooncake_url import P2P, parse_mooncake_url, reachable, route_address

OBJECT_NOT_FOUND, REPLICA_NOT_READY, OBJECT_EXISTS, LEASE_EXPIRED = -704, -703, -705, -707
INVALID_PARAMS, NO_SPACE, TRANSFER_FAIL = -600, -200, -800
MISSING = {OBJECT_NOT_FOUND: "not found", REPLICA_NOT_READY: "still being written", LEASE_EXPIRED: "lease expired"}
CODES = {-200: "no space (NO_AVAILABLE_HANDLE)", -600: "invalid parameters", -703: "replica not ready",
         -704: "object not found", -705: "object exists", -706: "object has a lease", -707: "lease expired",
         -800: "transfer failed", -900: "RPC failed (the master is unreachable)", -901: "RPC timed out"}
SCRATCH_ALIGN = 4096
RPC_TIMEOUT_MS = 3000
"""A call to a master that stopped answering gives up after this (``MC_RPC_TIMEOUT_MS``, Mooncake's default 30 s;
kvtier sets it unless the environment does)."""
PIPELINE_BYTES = 64 << 20
"""Bytes per transfer while the part before is verified. Measured on 2 cores (loopback TCP, 2 MiB and 8 MiB
pages): parts of 16 MiB read 10-20% slower than parts of 64 MiB or more (smaller Mooncake calls, and no spare
core to verify on meanwhile), so a default batch of 32 two-MiB pages goes whole; larger batches go in parts."""


_SET_UP_IN: set[int] = set()
"""The process that set up a Mooncake client (a fork child has the parent's pid here, not its own)."""
_CLIENTS: list[Any] = []
"""Every client set up in this process. A fork child must never destroy one (its destructor crashes there): after a
fork each gets a reference that is never given back, and the child's stores only drop theirs."""


def _keep_inherited_clients() -> None:
    for client in _CLIENTS:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))


os.register_at_fork(after_in_child=_keep_inherited_clients)


class MooncakeForked(Exception):
    """This process is a fork of one with a Mooncake client: no client can work here (counted, never a hang)."""


class MooncakeError(Exception):
    """A Mooncake call failed as a whole (the store's fault, not a page's): counted, the store goes down."""

    def __init__(self, call: str, code: int, where: str, hint: str = "") -> None:
        said = CODES.get(code, "error")
        super().__init__(f"{call} on the Mooncake store at {where}: {code} ({said}){hint}")
        self.code = code


BENIGN = ("Logging before InitGoogleLogging", "metadata not found", "Failed to retrieve segment descriptor",
          "Local segment descriptor not found")
"""What a Mooncake client prints on stderr every time it sets up (its first look-up of itself): not ours to show."""
_STDERR_LOCK = named_lock("storage.mooncake_stderr", fork_safe=True)


@contextlib.contextmanager
def _benign_lines_dropped() -> Iterator[None]:
    """Hold what the process writes to its stderr (fd 2) for the block, then pass on every line but Mooncake's
    set-up chatter: a command's error stays one line, and nothing anyone else wrote meanwhile is lost."""
    with _STDERR_LOCK, tempfile.TemporaryFile() as held:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True)
                    if not any(word.encode() in line for word in BENIGN)]
            if kept:
                os.write(2, b"".join(kept))


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


class _Scratch:
    """Registered blocks for headers, namespace records and bounced pages: registering costs a call into the
    transfer engine (an RDMA memory region on RDMA), so blocks are kept and reused, and released with the client."""

    def __init__(self, client: Any, where: str) -> None:
        self.client, self.where = client, where
        self._lock = named_lock("storage.mooncake_scratch")
        self._free: dict[int, list[np.ndarray]] = {}
        self._all: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        size = -(-max(nbytes, 1) // SCRATCH_ALIGN) * SCRATCH_ALIGN
        with self._lock:
            if self._free.get(size):
                return self._free[size].pop()
        raw = np.empty(size + SCRATCH_ALIGN, np.uint8)
        start = -raw.ctypes.data % SCRATCH_ALIGN
        block = raw[start:start + size]
        code = self.client.register_buffer(block.ctypes.data, size)
        if code != 0:
            raise MooncakeError("register_buffer", code, self.where)
        with self._lock:
            self._all.append(block)
        return block

    def give(self, block: np.ndarray) -> None:
        with self._lock:
            self._free.setdefault(block.nbytes, []).append(block)

    def release(self) -> None:
        with self._lock:
            blocks, self._all, self._free = self._all, [], {}
        for block in blocks:
            with contextlib.suppress(Exception):
                self.client.unregister_buffer(block.ctypes.data)


class MooncakeStore(StorageBackend):
    kind = "mooncake"
    exists_batch = 4096        # one batch_is_exist for a 64k-token chain of 16-token pages

    def __init__(self, spec: str, namespace: Namespace | None, *, prefix: str = "kvtier", segment_bytes: int = 0,
                 buffer_bytes: int = 16 << 20, connect_timeout: float = 2.0, **options: Any) -> None:
        """``spec`` and every option are checked here, before anything connects (:mod:`~kvtier.storage.mooncake_url`).
        ``segment_bytes``: memory this process lends the store (0: it only uses memory others lend — a
        ``mooncake_client --global_segment_size=…`` holder outlives the processes that write, so their pages stay);
        ``buffer_bytes``: the client's own transfer buffer (pages never go through it); ``connect_timeout``: seconds
        the probe of the master waits."""
        super().__init__(namespace, **options)
        if not isinstance(prefix, str) or not prefix or ":" in prefix or not prefix.isprintable():
            raise InvalidArgument(f"prefix={prefix!r}: a non-empty name without ':'")
        segment_bytes = integer(segment_bytes, "segment_bytes", low=0, high=1 << 50)
        buffer_bytes = integer(buffer_bytes, "buffer_bytes", low=1 << 20, high=1 << 40)
        self.connect_timeout = positive_number(connect_timeout, "connect_timeout", unit="seconds")
        self.target = parse_mooncake_url(spec)
        self.where = self.target.master
        self.prefix, self.segment_bytes, self.buffer_bytes = prefix, segment_bytes, buffer_bytes
        self._client_lock = named_lock("storage.mooncake_client")
        self._client: Any = None
        self._client_pid = 0
        self._scratch: _Scratch | None = None
        self._spans: list[tuple[int, int]] = []          # registered (start, end), sorted; under _client_lock
        self._transfers: ThreadPoolExecutor | None = None
        self._transfers_pid = 0
        self._calls = named_condition("storage.mooncake_calls")
        self._in_flight = 0
        self._calls_pid = os.getpid()                    # whose calls _in_flight counts (a fork child's start at 0)
        self._record = json.dumps(self.describe()).encode() if namespace is not None else b""

    def __repr__(self) -> str:
        return f"MooncakeStore({self.where}, namespace {self.namespace_id})"

    # -- the client --------------------------------------------------------------------------------------------------
    def client(self) -> Any:
        """The Mooncake client, set up on first use, after the master (and an HTTP metadata server) answered a TCP
        probe. In a fork child of a process that set one up, MooncakeForked (a counted error): a Mooncake client
        does not survive fork, and a new one hangs in its set-up there."""
        with self._client_lock:
            if self.closed:
                raise StorageError(f"{self!r} is closed")
            if self._client is not None and self._client_pid == os.getpid():
                return self._client
            if _SET_UP_IN and os.getpid() not in _SET_UP_IN:
                raise MooncakeForked(f"{self!r}: this process was forked from one that had set up a Mooncake "
                                     f"client, and a Mooncake client does not survive fork (its calls hang or "
                                     f"crash): open the store in a process started with spawn")
            self._probe()
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")     # its INFO lines, a dozen a client, are not ours
            os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
            from mooncake.store import MooncakeDistributedStore

            client = MooncakeDistributedStore()
            target = self.target
            local = target.local_hostname or route_address(target.host, target.port)
            with _benign_lines_dropped():
                code = client.setup(local, target.metadata, self.segment_bytes, self.buffer_bytes,
                                    target.protocol, target.device, target.master)
            if code != 0:
                with contextlib.suppress(Exception):
                    client.close()
                raise MooncakeError("setup", code, self.where)
            scratch = _Scratch(client, self.where)
            for start, end in self._spans:
                code = client.register_buffer(start, end - start)
                if code != 0:
                    scratch.release()
                    with contextlib.suppress(Exception):
                        client.close()
                    raise MooncakeError("register_buffer", code, self.where)
            self._client, self._client_pid, self._scratch = client, os.getpid(), scratch
            _SET_UP_IN.add(os.getpid())
            _CLIENTS.append(client)
            return client

    def _probe(self) -> None:
        """Raise unless the master takes a connection and an HTTP server it runs answers within
        ``connect_timeout``: a frozen (stopped, swapping) master still accepts connections in its kernel's backlog,
        and a client set up against it holds the GIL until it gives up."""
        target = self.target
        why = reachable(target.host, target.port, self.connect_timeout)
        if why:
            raise ConnectionError(f"the Mooncake master is unreachable: {why}")
        if target.admin is not None:
            url, what = f"{target.admin}/health", "the Mooncake master's admin endpoint"
        elif target.metadata != P2P:
            url, what = f"{target.metadata}?key=kvtier-probe", "the Mooncake metadata server"
        else:
            return
        try:
            with urllib.request.urlopen(url, timeout=self.connect_timeout):
                pass
        except urllib.error.HTTPError:
            pass                                     # it answered: a 404 for the probe's key is an answer
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"{what} does not answer: {url}: {getattr(exc, 'reason', exc)}") from None

    @contextlib.contextmanager
    def _live(self) -> Iterator[tuple[Any, _Scratch]]:
        """The client for a call, counted in flight so that ``close`` waits for it before it closes the client
        (a Mooncake call racing its client's close crashes); while the store is down, the master is probed first
        (refused at once) rather than left to the client's own timeouts (4 s an RPC)."""
        with self._calls:
            if self.closed:
                raise StorageError(f"{self!r} is closed")
            if self._calls_pid != os.getpid():        # a fork child: the parent's calls in flight are not its own
                self._in_flight, self._calls_pid = 0, os.getpid()
            self._in_flight += 1
        try:
            if not self.up:
                self._probe()
            client = self.client()
            scratch = self._scratch
            assert scratch is not None
            yield client, scratch
        finally:
            with self._calls:
                self._in_flight -= 1
                self._calls.notify_all()

    def register_memory(self, address: CpuAddress, nbytes: int) -> None:
        """Register host memory (by its CPU address) with the store, so pages in it move with no copy."""
        if not isinstance(address, CpuAddress):
            raise InvalidArgument(f"register_memory takes a CpuAddress (the CPU side of host memory), got "
                                  f"{type(address).__name__}: a device alias must never reach a storage engine")
        if type(nbytes) is not int or nbytes < 1:
            raise InvalidArgument(f"register_memory: nbytes={nbytes!r}, whole bytes >= 1")
        span = (address.value, address.value + nbytes)
        with self._client_lock:
            if self.closed:
                raise StorageError(f"{self!r} is closed")
            if any(start < span[1] and span[0] < end for start, end in self._spans):
                raise InvalidArgument(f"register_memory: {address} (+{nbytes}) overlaps memory already registered")
            if self._client is not None and self._client_pid == os.getpid():
                code = self._client.register_buffer(span[0], nbytes)
                if code != 0:
                    raise StorageError(f"{self!r}: register_buffer of {address} (+{nbytes}) failed: {code} "
                                       f"({CODES.get(code, 'error')})")
            bisect.insort(self._spans, span)

    def unregister_memory(self, address: CpuAddress) -> None:
        """Forget memory registered at ``address`` (before it is freed). Unknown addresses are ignored, and so is a
        closed store (closing unregistered everything)."""
        if not isinstance(address, CpuAddress):
            raise InvalidArgument(f"unregister_memory takes a CpuAddress, got {type(address).__name__}")
        with self._client_lock:
            found = [span for span in self._spans if span[0] == address.value]
            if not found:
                return
            self._spans.remove(found[0])
            if self._client is not None and self._client_pid == os.getpid():
                with contextlib.suppress(Exception):
                    self._client.unregister_buffer(address.value)

    @property
    def registered(self) -> list[tuple[CpuAddress, int]]:
        """The memory registered with :meth:`register_memory` now: (CPU address, bytes), in address order."""
        with self._client_lock:
            return [(CpuAddress(start), end - start) for start, end in self._spans]

    def _registered(self, view: memoryview) -> bool:
        start = _address(view)
        spans = self._spans
        at = bisect.bisect_right(spans, (start, float("inf"))) - 1
        return at >= 0 and spans[at][0] <= start and start + view.nbytes <= spans[at][1]

    def key(self, key: bytes) -> str:
        return f"{self.prefix}:{self.namespace_id}:p:{key.hex()}"

    def record_key(self) -> str:
        """Where the namespace's description lives."""
        return f"{self.prefix}:{self.namespace_id}:namespace"

    # -- the backend -------------------------------------------------------------------------------------------------
    def _exists(self, keys: list[bytes]) -> list[bool]:
        with self._live() as (client, _):
            found = client.batch_is_exist([self.key(k) for k in keys])
        if len(found) != len(keys) or any(code < 0 for code in found):
            bad = next((c for c in found if c < 0), -1)
            raise MooncakeError("batch_is_exist", bad, self.where)
        return [code == 1 for code in found]

    def _buffers(self, scratch: _Scratch, pages: list[list[memoryview]], headers: np.ndarray,
                 *, into: bool) -> tuple[list[list[int]], list[list[int]], list[tuple[int, np.ndarray]]]:
        """Per page: the addresses and sizes of its header slot and pieces (a bounce block where a piece lies
        outside registered memory); the bounced pages (index, block), copied in here when writing."""
        addresses: list[list[int]] = []
        sizes: list[list[int]] = []
        bounced: list[tuple[int, np.ndarray]] = []
        base = headers.ctypes.data
        with self._client_lock:
            direct = [all(self._registered(p) for p in pieces) for pieces in pages]
        for i, pieces in enumerate(pages):
            if direct[i]:
                addresses.append([base + i * HEADER_BYTES, *(_address(p) for p in pieces)])
                sizes.append([HEADER_BYTES, *(p.nbytes for p in pieces)])
                continue
            block = scratch.take(self.page_bytes)
            bounced.append((i, block))
            if not into:
                at = 0
                for piece in pieces:
                    block[at:at + piece.nbytes] = np.frombuffer(piece, np.uint8)
                    at += piece.nbytes
            addresses.append([base + i * HEADER_BYTES, block.ctypes.data])
            sizes.append([HEADER_BYTES, self.page_bytes])
        return addresses, sizes, bounced

    def _get(self, keys: list[bytes], pages: list[list[memoryview]]) -> Iterator[PageRejected | None]:
        """The batch in parts of about ``PIPELINE_BYTES``: while one part is verified (on the I/O threads), the
        next is in flight on the store's transfer thread, so checking the bytes costs little beyond moving them.
        Stopped early (a miss), it waits for the part in flight before it returns."""
        with self._live() as (client, scratch):
            headers = scratch.take(len(keys) * HEADER_BYTES)
            bounced: list[tuple[int, np.ndarray]] = []
            pending: Future[list[int]] | None = None
            try:
                addresses, sizes, bounced = self._buffers(scratch, pages, headers, into=True)
                names = [self.key(k) for k in keys]
                if bounced:
                    self.counters.add("bounced_pages", len(bounced))
                sources = {i: block[:self.page_bytes] for i, block in bounced}
                step = max(1, -(-PIPELINE_BYTES // self.stored_bytes))
                parts = [(lo, min(lo + step, len(keys))) for lo in range(0, len(keys), step)]

                def fetch(lo: int, hi: int) -> list[int]:
                    codes = client.batch_get_into_multi_buffers(names[lo:hi], addresses[lo:hi], sizes[lo:hi])
                    if len(codes) != hi - lo:
                        raise MooncakeError("batch_get_into_multi_buffers", -1, self.where)
                    return list(codes)

                transfers = self._transfer_thread() if len(parts) > 1 else None
                codes = fetch(*parts[0])
                for index, (lo, hi) in enumerate(parts):
                    if index:
                        assert pending is not None
                        codes, pending = pending.result(), None
                    if transfers is not None and index + 1 < len(parts):
                        pending = transfers.submit(fetch, *parts[index + 1])
                    codes = [self._sized(client, name, code) for name, code in zip(names[lo:hi], codes, strict=True)]
                    yield from self._ordered(self._verify, keys[lo:hi], pages[lo:hi], codes,
                                             [headers[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] for i in range(lo, hi)],
                                             [sources.get(i) for i in range(lo, hi)])
            finally:
                if pending is not None:                  # nothing may still write into the caller's pages
                    wait([pending])
                scratch.give(headers)
                for _, block in bounced:
                    scratch.give(block)

    def _transfer_thread(self) -> ThreadPoolExecutor:
        """The thread that runs the next part's transfer (one per store and process, made on first use)."""
        with self._client_lock:
            if self.closed:
                raise StorageError(f"{self!r} is closed")
            if self._transfers is None or self._transfers_pid != os.getpid():
                self._transfers = ThreadPoolExecutor(1, thread_name_prefix="kvtier-mooncake-transfer")
                self._transfers_pid = os.getpid()
            return self._transfers

    def _sized(self, client: Any, name: str, code: int) -> int:
        """A page's read result, where a failed one is told apart: an object of another size than a page fails
        its transfer (``-800``, or ``-600`` when larger) and is a miss (its size is the result); any other failure,
        or a transfer failure of an object of the right size, is the store's and raises."""
        if code >= 0 or code in MISSING:
            return code
        size = client.get_size(name) if code in (INVALID_PARAMS, TRANSFER_FAIL) else code
        if size in MISSING or (size >= 0 and size != self.stored_bytes):
            return size
        raise MooncakeError("batch_get_into_multi_buffers", code, self.where)

    def _verify(self, key: bytes, pieces: list[memoryview], code: int, header: np.ndarray,
                bounce: np.ndarray | None) -> PageRejected | None:
        if code in MISSING:
            return PageRejected("absent", f"{self.key(key)}: {MISSING[code]}")
        if code != self.stored_bytes:
            reason = "short" if code < self.stored_bytes else "geometry"
            return PageRejected(reason, f"{self.key(key)} holds {code} bytes; a page of this namespace takes "
                                        f"{self.stored_bytes}")
        try:
            checksum = self.format.check_header(header, key)
            self.format.check_payload(header, checksum, pieces if bounce is None else [bounce])
        except PageRejected as rejected:
            return rejected
        if bounce is not None:
            at = 0
            for piece in pieces:
                np.copyto(np.frombuffer(piece, np.uint8), bounce[at:at + piece.nbytes])
                at += piece.nbytes
        return None

    def _set(self, keys: list[bytes], pages: list[list[memoryview]]) -> int:
        """One batch put of the pages (header slot + pieces each) and the namespace record in front: a restarted
        master, an evicted record or one removed by hand is back with the next write, at no extra round trip.
        A page already stored is left as it is (a key names its content)."""
        with self._live() as (client, scratch):
            count = len(keys) + 1
            headers = scratch.take(count * HEADER_BYTES + len(self._record))
            bounced: list[tuple[int, np.ndarray]] = []
            try:
                addresses, sizes, bounced = self._buffers(scratch, pages, headers, into=False)
                for i, header in enumerate(self._ordered(self.format.header, keys, pages)):   # xxhash drops the GIL
                    headers[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] = np.frombuffer(header, np.uint8)
                record_at = count * HEADER_BYTES
                headers[record_at:record_at + len(self._record)] = np.frombuffer(self._record, np.uint8)
                names = [self.record_key(), *(self.key(k) for k in keys)]
                addresses.insert(0, [headers.ctypes.data + record_at])
                sizes.insert(0, [len(self._record)])
                codes = client.batch_put_from_multi_buffers(names, addresses, sizes)
                if bounced:
                    self.counters.add("bounced_pages", len(bounced))
            finally:
                scratch.give(headers)
                for _, block in bounced:
                    scratch.give(block)
            if len(codes) != count:
                raise MooncakeError("batch_put_from_multi_buffers", -1, self.where)
            stored = 0
            for code in codes[1:]:
                if code not in (0, OBJECT_EXISTS):
                    hint = ("; no segment has room: start a segment holder (mooncake_client --global_segment_size=…) "
                            "or open the store with segment_bytes=" if code == NO_SPACE else "")
                    error = MooncakeError("batch_put_from_multi_buffers", code, self.where, hint)
                    raise PartialWrite(stored, error) if stored else error
                stored += 1
            return stored

    def _delete(self, keys: list[bytes]) -> int:
        """Remove these pages, even while another client holds a lease on one (its read then fails its checksum
        or finds the page gone: a miss)."""
        with self._live() as (client, _):
            codes = client.batch_remove([self.key(k) for k in keys], True)
        failed = next((c for c in codes if c < 0 and c != OBJECT_NOT_FOUND), None)
        if failed is not None:
            raise MooncakeError("batch_remove", failed, self.where)
        return sum(1 for c in codes if c == 0)

    def _admin(self, path: str) -> str:
        """A page of the master's HTTP admin endpoint (operators' calls only)."""
        admin = self.target.admin
        if admin is None:
            raise StorageError(f"{self!r}: listing a Mooncake store needs its master's admin endpoint: add "
                               f"?admin=http://MASTER_HOST:9003 to the spec (mooncake_master --metrics_port)")
        with urllib.request.urlopen(f"{admin}/{path}", timeout=max(self.connect_timeout, 10.0)) as reply:
            return str(reply.read().decode(errors="replace"))

    def _names(self) -> list[str]:
        """Every object name of this prefix the master holds."""
        if self.target.admin is not None:
            self.client()
        text = self._admin("get_all_keys")
        return [line.strip() for line in text.splitlines() if line.startswith(f"{self.prefix}:")]

    def usage(self) -> dict[str, int]:
        """The store's memory as its master counts it (every prefix): bytes allocated, capacity the segments
        lend, objects, and objects evicted so far (operators: ``kvtier storage stats``)."""
        wanted = {"master_allocated_bytes": "allocated_bytes", "master_total_capacity_bytes": "capacity_bytes",
                  "master_key_count": "objects", "master_evicted_key_count": "evicted_objects"}
        found: dict[str, int] = {}
        for line in self._admin("metrics").splitlines():
            name, _, value = line.partition(" ")
            if name in wanted:
                found[wanted[name]] = int(float(value))
        return found

    def _entries(self) -> Iterator[Entry]:
        client = self.client()
        for name in self._names():
            parts = name.split(":", 3)
            if len(parts) != 4 or parts[2] != "p":
                continue
            size = client.get_size(name)
            if size > 0:
                yield Entry(parts[1], parts[3], size)

    def _namespaces(self) -> dict[str, dict[str, Any] | None]:
        client = self.client()
        found: dict[str, dict[str, Any] | None] = {}
        for name in self._names():
            parts = name.split(":")
            if len(parts) == 3 and parts[2] == "namespace":
                raw = client.get(name)
                try:
                    found[parts[1]] = json.loads(bytes(raw)) if raw else None
                except ValueError:
                    found[parts[1]] = None
            elif len(parts) == 4 and parts[2] == "p":
                found.setdefault(parts[1], None)
        return found

    def _remove(self, namespace_id: str | None) -> int:
        pattern = f"^{re.escape(self.prefix)}:{namespace_id or '[0-9a-f]{16}'}:p:[0-9a-f]{{64}}$"
        removed = self.client().remove_by_regex(pattern, True)
        if removed < 0:
            raise MooncakeError("remove_by_regex", removed, self.where)
        return int(removed)

    def _close(self) -> None:
        if self._calls_pid == os.getpid():       # calls begun before close finish first (see _live); in a fork
            with self._calls:                    # child, the parent's never will: no thread of the child runs them
                self._calls.wait_for(lambda: self._in_flight == 0)
        with self._client_lock:
            client, self._client = self._client, None
            scratch, self._scratch = self._scratch, None
            transfers, self._transfers = self._transfers, None
            mine = self._client_pid == os.getpid()
            self._spans = []
        if transfers is not None and self._transfers_pid == os.getpid():
            transfers.shutdown(wait=True)
        if client is None or not mine:
            return
        if scratch is not None:
            scratch.release()
        with contextlib.suppress(Exception):     # nothing else to release
            client.close()
        with contextlib.suppress(ValueError):
            _CLIENTS.remove(client)

