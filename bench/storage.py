"""Storage benchmark: ``set`` / ``get`` of whole pages through kvtier's backends, beside the same bytes through plain
tools in the same run, and the latency of a prefetch of a long chain through the cache.

Pages (bf16): Llama-3-8B with 16 and 64 tokens (32 layers, K and V: 2 MiB and 8 MiB) and DeepSeek-V3 MLA with 64
tokens (61 layers of 1152-byte latents: 4.3 MiB), read from and written to a ``page_first`` host pool (two pieces
per MHA page, one per MLA page). About ``--mib`` MiB of pages per row.

Every row names its ceiling (the plain tool doing the same work at kvtier's concurrency) and kvtier's % of it; the
other references of the same run are listed beside it, each with its role:
- file: ceiling ``pwritev`` / ``preadv`` of one plain file per page on as many threads as kvtier's I/O threads (no
  header, checksum, temporary file or rename); typical user: the same files with ``write`` / ``readinto`` on one
  thread; medium bound: one sequential file of the same total bytes (``writev`` / ``readv``, one thread). Warm rows
  read from the page cache, cold rows after ``fsync`` + ``POSIX_FADV_DONTNEED`` on every file, for everyone.
- redis: ceiling a raw RESP client on a plain socket (no library: commands written with ``sendmsg`` from the
  pages' buffers, replies read with ``recv_into`` straight into preallocated buffers) sending what kvtier sends
  (``SET`` 32 at a time; the reads asked as kvtier asks them: the same ``GET`` / ``STRLEN`` + ``GETRANGE`` and the
  same number in flight); peers: the same raw client with a whole batch of 32 ``GET``\\s in flight,
  ``redis-benchmark -P 32 -c 1`` with values of the same size (its own timing; its data is its own and its client
  drops what it reads, so only its stored value's size is checked) and kvtier's previous read path (redis-py parses
  each reply into a ``bytes``, checked, then copied into the page); typical user: redis-py's pipelined ``SET`` of a
  prepared ``bytes`` value and ``GET``, batches of 32.
- mooncake: ceiling Mooncake's own ``batch_put_from`` / ``batch_get_into`` of the same bytes from and into one
  registered contiguous buffer (no header, no checksum, batches of 32); peer: its multi-buffer get into kvtier's
  pieces, unchecked.

Every contender's bytes are verified, every timed call: destinations poisoned (0xA5, never zeros) before it, every
byte compared with the source after it (a write is read back; a stored page removed before the next write); a
mismatch ends the run with exit status 1 and one line saying where. ``KVTIER_BENCH_PLANT=1`` corrupts one destination
byte after the timed copy, before the check, so a run can be shown failing. Contenders run in turns (medians of
``--repeats``), so drift in the machine hits all alike.

Prefetch rows: a cache whose storage holds a ``--prefetch-tokens`` chain (Llama-3-8B, 16-token pages) in a fresh
process-like state (empty host tier): ``prefetch(tokens)`` until the whole chain is in the host tier, then every
page's bytes checked against what was written. ``touched``: the host pool's memory was written once before (as a
serving process's is after its first backups); ``fresh``: the first write of each memory page is in the timed read.

Usage: python bench/storage.py [--stores file,redis,mooncake] [--redis URL] [--mooncake SPEC] [--dir PATH] [--json PATH]
Without ``--redis`` a private redis-server is started when one is installed; without ``--mooncake`` a private
Mooncake Store (``scripts/mooncake_servers.sh``) when the Mooncake wheel is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import xxhash
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _options import name_list  # noqa: E402
from _servers import start_mooncake, start_redis, stop_mooncake, stop_redis  # noqa: E402

from kvtier.cache import CacheSettings, KVCache, Namespace, page_keys  # noqa: E402
from kvtier.pools import DevicePool, HostLayout, HostPool, KVGeometry  # noqa: E402
from kvtier.runtime import get as get_runtime  # noqa: E402
from kvtier.storage import HostPages, open_store, redis_store  # noqa: E402
from kvtier.storage.format import HEADER_BYTES  # noqa: E402
from kvtier.storage.redis_reader import ReadPlan  # noqa: E402

SIZES = {
    "llama3-8b-p16": KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16),
    "llama3-8b-p64": KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=64),
    "deepseek-v3-p64": KVGeometry.mla(layers=61, latent_bytes=1152, page_size=64),
}
BATCH = 32
POISON = 0xA5
PLANT = "KVTIER_BENCH_PLANT"
IOV_MAX = 1024

Pages = list[list[memoryview]]


# -- verification: every byte a contender moved ---------------------------------------------------------------------
class Mismatch(Exception):
    """A contender's bytes differ from the source: the run ends, exit status 1, with this one line."""


def poison(pages: Sequence[Sequence[Any]]) -> None:
    for page in pages:
        for piece in page:
            np.frombuffer(piece, np.uint8)[:] = POISON


def check_copy(what: str, source: Sequence[Sequence[Any]], copy: Sequence[Sequence[Any]]) -> None:
    """Every byte of ``copy`` equals ``source``'s, page by page (each a list of buffers, cut anywhere), else
    Mismatch. With KVTIER_BENCH_PLANT=1 one byte of the copy is corrupted first (a run shown failing)."""
    if os.environ.get(PLANT) == "1":
        copy = [list(page) for page in copy]
        last = np.frombuffer(copy[-1][-1], np.uint8)
        if not last.flags.writeable:                   # a reply object: its copy is corrupted instead
            last = copy[-1][-1] = last.copy()
        last[-1] ^= 0xFF
    if len(copy) != len(source):
        raise Mismatch(f"{what}: {len(copy)} pages, {len(source)} in the source")
    for index, (want, got) in enumerate(zip(source, copy, strict=True)):
        wrong = first_difference([np.frombuffer(b, np.uint8) for b in want], [np.frombuffer(b, np.uint8) for b in got])
        if wrong is not None:
            raise Mismatch(f"{what}: page {index} differs from the source (first at byte {wrong} of the page)")


def first_difference(a: list[np.ndarray], b: list[np.ndarray]) -> int | None:
    """Where two byte streams, each in buffers cut anywhere, first differ (or one ends), or None."""
    if sum(x.size for x in a) != sum(y.size for y in b):
        return min(sum(x.size for x in a), sum(y.size for y in b))
    i = j = at_a = at_b = done = 0
    while i < len(a) and j < len(b):
        count = min(a[i].size - at_a, b[j].size - at_b)
        x, y = a[i][at_a:at_a + count], b[j][at_b:at_b + count]
        if not np.array_equal(x, y):
            return done + int(np.flatnonzero(x != y)[0])
        at_a, at_b, done = at_a + count, at_b + count, done + count
        if at_a == a[i].size:
            i, at_a = i + 1, 0
        if at_b == b[j].size:
            j, at_b = j + 1, 0
    return None


def mirrored(source: Pages, memory: np.ndarray) -> Pages:
    """Buffers in ``memory`` cut as ``source``'s pages and pieces (a destination every contender shares)."""
    out, at = [], 0
    for page in source:
        row = []
        for piece in page:
            row.append(memoryview(memory[at:at + piece.nbytes]))
            at += piece.nbytes
        out.append(row)
    return out


# -- timing ----------------------------------------------------------------------------------------------------------
@dataclass
class Contender:
    """One way of moving the row's bytes: ``run`` is timed; ``before`` (poison, remove, drop caches) and ``check``
    (compare every byte) run around every timed call, untimed."""

    name: str
    role: str                                       # kvtier, ceiling, typical user, peer, medium bound
    run: Callable[[], None]
    before: Callable[[], None] | None = None
    check: Callable[[], None] | None = None
    verified: str = "every byte, every call"


def timed(contenders: list[Contender], repeats: int, settle: bool = False) -> dict[str, float]:
    """Median seconds per contender, run in turns. ``settle``: ``os.sync()`` before each timed call (no writeback
    under a read)."""
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for _ in range(repeats):
        for contender in contenders:
            if contender.before:
                contender.before()
            if settle:
                os.sync()
            start = time.perf_counter()
            contender.run()
            times[contender.name].append(time.perf_counter() - start)
            if contender.check:
                contender.check()
    return {name: statistics.median(values) for name, values in times.items()}


def row(store: str, size: str, op: str, state: str, nbytes: int, contenders: list[Contender],
        seconds: dict[str, float], measured: Sequence[dict] = ()) -> dict:
    """kvtier's speed, its ceiling's (the first contender of role ``ceiling``) and every reference, with kvtier's %
    of each. ``measured``: references timed by themselves (redis-benchmark), as dicts with name, role, gbps."""
    kvtier = next(c for c in contenders if c.role == "kvtier")
    gbps = nbytes / seconds[kvtier.name] / 1e9
    references = [{"name": c.name, "role": c.role, "gbps": nbytes / seconds[c.name] / 1e9, "verified": c.verified}
                  for c in contenders if c is not kvtier] + list(measured)
    for reference in references:
        reference["kvtier_pct"] = 100 * gbps / reference["gbps"] if reference["gbps"] else None
    ceiling = next((r for r in references if r["role"] == "ceiling"), None)
    return {"store": store, "page": size, "op": op, "cache": state, "bytes": nbytes, "gbps": gbps,
            "verified": kvtier.verified, "ceiling": ceiling["name"] if ceiling else None,
            "ceiling_gbps": ceiling["gbps"] if ceiling else None, "pct": ceiling["kvtier_pct"] if ceiling else None,
            "references": references}


# -- file ------------------------------------------------------------------------------------------------------------
def drop_cache(paths: list[Path]) -> None:
    """Write back and drop the page cache of these files (clean pages go at POSIX_FADV_DONTNEED)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def vectored(call: Callable[..., int], fd: int, buffers: list[memoryview], offset: int | None = None) -> None:
    """All of ``buffers`` through ``writev``/``readv`` (or ``pwritev``/``preadv`` at ``offset``), IOV_MAX at a
    time; a short transfer is an error."""
    for start in range(0, len(buffers), IOV_MAX):
        chunk = buffers[start:start + IOV_MAX]
        want = sum(b.nbytes for b in chunk)
        done = call(fd, chunk) if offset is None else call(fd, chunk, offset)
        if done != want:
            raise OSError(f"{call.__name__} moved {done} of {want} bytes")
        if offset is not None:
            offset += done


def file_rows(run: dict[str, Any], name: str, repeats: int, directory: Path) -> list[dict]:
    store, keys, pieces, into, mirror, nbytes = (run[k] for k in ("store", "keys", "pieces", "into", "mirror",
                                                                   "nbytes"))
    plain_dir = directory / f"plain-{time.time_ns()}"
    plain_dir.mkdir(parents=True)
    plain = [plain_dir / f"{i}.bin" for i in range(len(keys))]
    sequential = plain_dir / "sequential.bin"
    threads = store.io_threads
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-plain")

    def write_plain(i: int) -> None:
        fd = os.open(plain[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            vectored(os.pwritev, fd, pieces[i], 0)
        finally:
            os.close(fd)

    def read_plain(i: int, into_: Pages) -> None:
        fd = os.open(plain[i], os.O_RDONLY)
        try:
            vectored(os.preadv, fd, into_[i], 0)
        finally:
            os.close(fd)

    def threaded_set() -> None:
        list(pool.map(write_plain, range(len(plain))))

    def threaded_get() -> None:
        list(pool.map(lambda i: read_plain(i, mirror), range(len(plain))))

    def one_thread_set() -> None:
        for path, page in zip(plain, pieces, strict=True):
            with open(path, "wb") as file:
                for piece in page:
                    file.write(piece)

    def one_thread_get() -> None:
        for path, page in zip(plain, mirror, strict=True):
            with open(path, "rb", buffering=0) as file:
                for piece in page:
                    file.readinto(piece)

    def sequential_set() -> None:
        fd = os.open(sequential, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            vectored(os.writev, fd, [p for page in pieces for p in page])
        finally:
            os.close(fd)

    def sequential_get() -> None:
        fd = os.open(sequential, os.O_RDONLY)
        try:
            vectored(os.readv, fd, [p for page in mirror for p in page])
        finally:
            os.close(fd)

    def read_back(reader: Callable[[], None], what: str) -> Callable[[], None]:
        def check() -> None:
            poison(mirror)
            reader()
            check_copy(what, pieces, mirror)
        return check

    def kv_read_back() -> None:
        assert store.get(keys, mirror) == len(keys), store.last_error

    def unlink(paths: list[Path]) -> Callable[[], None]:
        return lambda: [p.unlink(missing_ok=True) for p in paths]

    per_page = f"a file per page, {threads} threads"
    rows = []
    try:
        contenders = [
            Contender("kvtier", "kvtier", run["kv_set"], lambda: store.delete(keys),
                      read_back(kv_read_back, "kvtier set")),
            Contender(f"pwritev, {per_page}", "ceiling", threaded_set, unlink(plain),
                      read_back(threaded_get, "pwritev set")),
            Contender("write, a file per page, 1 thread", "typical user", one_thread_set, unlink(plain),
                      read_back(threaded_get, "write set")),
            Contender("writev, one sequential file, 1 thread", "medium bound", sequential_set, unlink([sequential]),
                      read_back(sequential_get, "sequential set"))]
        rows.append(row("file", name, "set", "", nbytes, contenders, timed(contenders, repeats, settle=True)))
        mine = [store.path(k) for k in keys]
        for state in ("warm", "cold"):
            def before(dest: Pages, paths: list[Path], cold: bool = state == "cold") -> Callable[[], None]:
                def prepare() -> None:
                    poison(dest)
                    if cold:
                        drop_cache(paths)
                return prepare

            contenders = [
                Contender("kvtier", "kvtier", run["kv_get"], before(into, mine),
                          lambda: check_copy("kvtier get", pieces, into)),
                Contender(f"preadv, {per_page}", "ceiling", threaded_get, before(mirror, plain),
                          lambda: check_copy("preadv get", pieces, mirror)),
                Contender("readinto, a file per page, 1 thread", "typical user", one_thread_get, before(mirror, plain),
                          lambda: check_copy("readinto get", pieces, mirror)),
                Contender("readv, one sequential file, 1 thread", "medium bound", sequential_get,
                          before(mirror, [sequential]), lambda: check_copy("sequential get", pieces, mirror))]
            rows.append(row("file", name, "get", state, nbytes, contenders, timed(contenders, repeats, settle=True)))
    finally:
        pool.shutdown()
        shutil.rmtree(plain_dir, ignore_errors=True)
    return rows


# -- redis -----------------------------------------------------------------------------------------------------------
class RawResp:
    """The ceiling's client: RESP on a plain socket, no library. Commands go out with ``sendmsg`` straight from the
    pages' buffers; replies come in with ``recv_into`` straight into the destination buffers (lines through a small
    buffer): what moving these bytes over this connection costs with no parsing into objects and no copy."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme == "unix":
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(parts.path)
        else:
            self.sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 6379))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = bytearray(1 << 16)
        self.view = memoryview(self.buffer)
        self.start = self.end = 0
        if parts.password:
            self.call(b"AUTH", *([unquote(parts.username).encode()] if parts.username else []),
                      unquote(parts.password).encode())
        db = parts.path.strip("/") if parts.scheme != "unix" else ""
        if db and db != "0":
            self.call(b"SELECT", db.encode())

    def close(self) -> None:
        self.sock.close()

    @staticmethod
    def command(*words: bytes) -> bytes:
        return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)

    def send(self, buffers: list[Any]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        while views:
            sent = self.sock.sendmsg(views[:IOV_MAX])
            while views and sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            if sent:
                views[0] = views[0][sent:]

    def line(self) -> bytes:
        while True:
            at = self.buffer.find(b"\r\n", self.start, self.end)
            if at >= 0:
                line, self.start = bytes(self.view[self.start:at]), at + 2
                return line
            if self.start == self.end:
                self.start = self.end = 0
            elif self.end > len(self.buffer) - 4096:
                pending = self.end - self.start
                self.buffer[:pending] = self.view[self.start:self.end]
                self.start, self.end = 0, pending
            got = self.sock.recv_into(self.view[self.end:self.end + 4096])
            if not got:
                raise ConnectionError("the server closed the connection")
            self.end += got

    def fill(self, target: memoryview) -> None:
        have = min(self.end - self.start, target.nbytes)
        target[:have] = self.view[self.start:self.start + have]
        self.start += have
        while have < target.nbytes:
            got = self.sock.recv_into(target[have:])
            if not got:
                raise ConnectionError("the server closed the connection")
            have += got

    def call(self, *words: bytes) -> bytes:
        self.send([self.command(*words)])
        reply = self.line()
        if reply[:1] == b"-":
            raise ConnectionError(reply.decode())
        return reply

    def set(self, names: list[bytes], values: list[list[Any]]) -> None:
        """``SET`` of each name to its value (the buffers, in order), BATCH commands at a time."""
        for start in range(0, len(names), BATCH):
            buffers: list[Any] = []
            for name, value in zip(names[start:start + BATCH], values[start:start + BATCH], strict=True):
                size = sum(memoryview(v).nbytes for v in value)
                buffers += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, size), *value, b"\r\n"]
            self.send(buffers)
            for _ in names[start:start + BATCH]:
                if self.line() != b"+OK":
                    raise ConnectionError("SET refused")

    def get(self, names: list[bytes], targets: list[list[memoryview]], window: int,
            ranges: list[tuple[int, int]] | None) -> None:
        """Each name's value into its targets (the buffers, in order): BATCH pages at a time, ``window`` of them
        asked ahead, each by ``GET`` or (``ranges``) ``STRLEN`` + a ``GETRANGE`` per range."""
        def asked(name: bytes) -> bytes:
            if ranges is None:
                return self.command(b"GET", name)
            return b"".join([self.command(b"STRLEN", name), *(self.command(b"GETRANGE", name, b"%d" % a,
                                                                           b"%d" % (b - 1)) for a, b in ranges)])

        for start in range(0, len(names), BATCH):
            batch = names[start:start + BATCH]
            requests = [asked(name) for name in batch]
            self.send([b"".join(requests[:window])])
            for i, parts in enumerate(targets[start:start + BATCH]):
                sizes = [sum(p.nbytes for p in parts)] if ranges is None else [b - a for a, b in ranges]
                if ranges is not None:
                    self.line()                                    # STRLEN's
                cursor = iter(parts)
                piece, at = next(cursor), 0
                for size in sizes:
                    if self.line() != b"$%d" % size:
                        raise ConnectionError("a reply of another size")
                    while size:
                        if at == piece.nbytes:
                            piece, at = next(cursor), 0
                        count = min(size, piece.nbytes - at)
                        self.fill(piece[at:at + count])
                        at += count
                        size -= count
                    if self.line():
                        raise ConnectionError("a reply longer than its length")
                if i + window < len(requests):
                    self.send([requests[i + window]])


def redis_benchmark(spec: str, size: int, count: int, repeats: int) -> tuple[list[dict], str]:
    """``redis-benchmark -t set,get -P 32 -c 1 -d size -n count --csv`` (count rounded up to whole pipelines),
    ``repeats`` times: its SET and GET rows (median requests/s × size), or none and why."""
    tool = shutil.which("redis-benchmark") or shutil.which("valkey-benchmark")
    parts = urlsplit(spec)
    if tool is None:
        return [], "redis-benchmark is not installed"
    if parts.scheme not in ("redis", "unix"):
        return [], f"redis-benchmark is not run against a {parts.scheme}:// server here"
    where = (["-s", parts.path] if parts.scheme == "unix"
             else ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)])
    if parts.password:
        where += ["-a", unquote(parts.password)] + (["--user", unquote(parts.username)] if parts.username else [])
    db = parts.path.strip("/") if parts.scheme != "unix" else ""
    if db:
        where += ["--dbnum", db]
    rates: dict[str, list[float]] = {"SET": [], "GET": []}
    requests = -(-count // BATCH) * BATCH                  # whole pipelines
    for _ in range(repeats):
        for attempt in range(2):                           # it gives up now and then ("All clients disconnected")
            done = subprocess.run([tool, *where, "-t", "set,get", "-P", str(BATCH), "-c", "1", "-d", str(size),
                                   "-n", str(requests), "--csv"], capture_output=True, text=True, timeout=600)
            if not done.returncode:
                break
            said = (done.stderr or done.stdout).strip().splitlines()
            if attempt:
                return [], f"redis-benchmark failed (exit {done.returncode}: {said[-1] if said else 'nothing said'})"
        for record in csv.reader(io.StringIO(done.stdout)):
            if record and record[0] in rates:
                rates[record[0]].append(float(record[1]))
    return [{"name": f"redis-benchmark -P {BATCH} -c 1", "role": "peer", "op": op.lower(),
             "gbps": statistics.median(values) * size / 1e9,
             "verified": "its stored value's size (its data is its own; its client drops what it reads)"}
            for op, values in rates.items()], ""


@contextlib.contextmanager
def previous_read_path() -> Iterator[None]:
    """kvtier's Redis reads as they were before its direct reader: redis-py parses each reply into a ``bytes``,
    verified, then copied into the page (the path the store keeps for connections it cannot read itself)."""
    real = redis_store.direct_socket
    redis_store.direct_socket = lambda connection: None
    try:
        yield
    finally:
        redis_store.direct_socket = real


def redis_rows(run: dict[str, Any], spec: str, name: str, repeats: int, console: Console) -> list[dict]:
    import redis

    store, keys, pieces, into, mirror, nbytes = (run[k] for k in ("store", "keys", "pieces", "into", "mirror",
                                                                   "nbytes"))
    count = len(keys)
    client = redis.Redis.from_url(spec)
    headers = [store.format.header(key, page) for key, page in zip(keys, pieces, strict=True)]
    values = [header + b"".join(bytes(p) for p in page) for header, page in zip(headers, pieces, strict=True)]
    raw_keys = [f"bench-raw:{store.namespace_id}:{k.hex()}".encode() for k in keys]
    kv_names = [store.key(k).encode() for k in keys]
    header_memory = np.empty((count, HEADER_BYTES), np.uint8)
    with_headers = [[memoryview(header_memory[i]), *page] for i, page in enumerate(mirror)]
    plan = ReadPlan(store.stored_bytes)
    raw = None
    got: list[Any] = []
    try:
        raw = RawResp(spec)
    except (OSError, ValueError) as exc:
        console.print(f"[yellow]no raw RESP ceiling for {spec}: {exc}")

    def kv_read_back() -> None:
        poison(mirror)
        assert store.get(keys, mirror) == count, store.last_error
        check_copy("kvtier set", pieces, mirror)

    def raw_read_back(what: str) -> Callable[[], None]:
        def check() -> None:
            poison(mirror)
            assert raw is not None
            raw.get(raw_keys, with_headers, BATCH, None)
            check_copy(what, pieces, mirror)
            assert all(bytes(h) == header for h, header in zip(header_memory, headers, strict=True)), what
        return check

    def py_set() -> None:
        for start in range(0, count, BATCH):
            pipe = client.pipeline(transaction=False)
            for key, value in zip(raw_keys[start:start + BATCH], values[start:start + BATCH], strict=True):
                pipe.set(key, value)
            pipe.execute()

    def py_get() -> None:
        got.clear()
        for start in range(0, count, BATCH):
            pipe = client.pipeline(transaction=False)
            for key in raw_keys[start:start + BATCH]:
                pipe.get(key)
            got.extend(pipe.execute())

    def py_check(what: str = "redis-py get") -> None:
        check_copy(what, pieces, [[memoryview(value or b"")[HEADER_BYTES:]] for value in got])

    def py_read_back() -> None:
        py_get()
        py_check("redis-py set")

    def kv_previous_get() -> None:
        with previous_read_path():
            run["kv_get"]()

    def delete_raw() -> None:
        client.delete(*raw_keys)

    sets = [Contender("kvtier", "kvtier", run["kv_set"], lambda: store.delete(keys), kv_read_back),
            Contender(f"redis-py pipeline of {BATCH} SETs", "typical user", py_set, delete_raw, py_read_back)]
    gets = [Contender("kvtier", "kvtier", run["kv_get"], lambda: poison(into),
                      lambda: check_copy("kvtier get", pieces, into)),
            Contender("kvtier's previous read path (redis-py replies)", "previous kvtier path", kv_previous_get,
                      lambda: poison(into), lambda: check_copy("previous path get", pieces, into)),
            Contender(f"redis-py pipeline of {BATCH} GETs", "typical user", py_get, got.clear, py_check)]
    if raw is not None:
        shape = "GET" if plan.ranges is None else f"STRLEN + {len(plan.ranges)} GETRANGEs"
        sets.insert(1, Contender(f"raw RESP, {BATCH} SETs in flight, zero-copy", "ceiling",
                                 lambda: raw.set(raw_keys, [[h, *p] for h, p in zip(headers, pieces, strict=True)]),
                                 delete_raw, raw_read_back("raw set")))
        gets[1:1] = [
            Contender(f"raw RESP, kvtier's requests ({shape}, {plan.window} pages in flight), zero-copy", "ceiling",
                      lambda: raw.get(kv_names, with_headers, plan.window, plan.ranges), lambda: poison(mirror),
                      lambda: check_copy("raw get", pieces, mirror)),
            Contender(f"raw RESP, {BATCH} GETs in flight, zero-copy", "peer",
                      lambda: raw.get(kv_names, with_headers, BATCH, None), lambda: poison(mirror),
                      lambda: check_copy("raw get, a batch in flight", pieces, mirror))]
    try:
        set_seconds = timed(sets, repeats)
        get_seconds = timed(gets, repeats)
        benchmark, why = redis_benchmark(spec, store.stored_bytes, count, repeats)
        if why:
            console.print(f"[yellow]{why}: no redis-benchmark rows")
        else:
            stored = client.strlen("key:__rand_int__")         # its data is its own: its size is what shows
            if stored != store.stored_bytes:
                raise Mismatch(f"redis-benchmark: its stored value is {stored} bytes, not {store.stored_bytes}")
            client.delete("key:__rand_int__")
        return [row("redis", name, op, "", nbytes, contenders, seconds, [b for b in benchmark if b["op"] == op])
                for op, contenders, seconds in (("set", sets, set_seconds), ("get", gets, get_seconds))]
    finally:
        client.delete(*raw_keys)
        client.close()
        if raw is not None:
            raw.close()


# -- mooncake --------------------------------------------------------------------------------------------------------
def mooncake_rows(run: dict[str, Any], name: str, repeats: int) -> list[dict]:
    """kvtier's Mooncake store against Mooncake's own batch calls of the same bytes, on the same client, from and
    into one registered contiguous buffer (a page per key, no header, no checksum); and Mooncake's own multi-buffer
    get of kvtier's stored pages into the pool's pieces, unchecked (what the API costs by itself)."""
    store, keys, pieces, into, nbytes = (run[k] for k in ("store", "keys", "pieces", "into", "nbytes"))
    client = store.client()
    count = len(pieces)
    page = nbytes // count
    source = np.concatenate([np.frombuffer(piece, np.uint8) for pieces_of in pieces for piece in pieces_of])
    target = np.full(nbytes, POISON, np.uint8)
    flat_source = [[memoryview(source[i * page:(i + 1) * page])] for i in range(count)]
    flat_target = [[memoryview(target[i * page:(i + 1) * page])] for i in range(count)]
    headers = np.empty(BATCH * HEADER_BYTES, np.uint8)
    for buffer in (source, target, headers):
        assert client.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
    raw_keys = [f"bench-raw:{time.time_ns()}:{i}" for i in range(count)]

    def batches(call, buffer) -> None:
        for start in range(0, count, BATCH):
            stop = min(start + BATCH, count)
            codes = call(raw_keys[start:stop], [buffer.ctypes.data + i * page for i in range(start, stop)],
                         [page] * (stop - start))
            assert all(code >= 0 for code in codes), codes

    def raw_set() -> None:
        batches(client.batch_put_from, source)

    def raw_get() -> None:
        batches(client.batch_get_into, target)

    def raw_delete() -> None:
        client.batch_remove(raw_keys, True)

    def raw_get_pieces() -> None:               # Mooncake's own, into kvtier's buffers: header slot + pieces
        for start in range(0, count, BATCH):
            stop = min(start + BATCH, count)
            names = [store.key(k) for k in keys[start:stop]]
            codes = client.batch_get_into_multi_buffers(
                names, [[headers.ctypes.data + (i - start) * HEADER_BYTES, *(piece_address(p) for p in into[i])]
                        for i in range(start, stop)],
                [[HEADER_BYTES, *(p.nbytes for p in into[i])] for i in range(start, stop)])
            assert all(code == store.stored_bytes for code in codes), codes

    def kv_read_back() -> None:
        poison(into)
        assert store.get(keys, into) == count, store.last_error
        check_copy("kvtier set", pieces, into)

    def raw_read_back() -> None:
        poison(flat_target)
        raw_get()
        check_copy("Mooncake batch_put_from", flat_source, flat_target)

    try:
        sets = [Contender("kvtier", "kvtier", run["kv_set"], lambda: store.delete(keys), kv_read_back),
                Contender("Mooncake batch_put_from, one registered buffer", "ceiling", raw_set, raw_delete,
                          raw_read_back)]
        gets = [Contender("kvtier", "kvtier", run["kv_get"], lambda: poison(into),
                          lambda: check_copy("kvtier get", pieces, into)),
                Contender("Mooncake batch_get_into, one registered buffer", "ceiling", raw_get,
                          lambda: poison(flat_target), lambda: check_copy("Mooncake batch_get_into", flat_source,
                                                                          flat_target)),
                Contender("Mooncake multi-buffer get into kvtier's pieces, unchecked", "peer", raw_get_pieces,
                          lambda: poison(into), lambda: check_copy("Mooncake multi-buffer get", pieces, into))]
        return [row("mooncake", name, "set", "", nbytes, sets, timed(sets, repeats)),
                row("mooncake", name, "get", "", nbytes, gets, timed(gets, repeats))]
    finally:
        raw_delete()
        for buffer in (source, target, headers):
            client.unregister_buffer(buffer.ctypes.data)


def piece_address(piece) -> int:
    return int(np.frombuffer(piece, np.uint8).__array_interface__["data"][0])


# -- one page size through one store ---------------------------------------------------------------------------------
def page_rows(store_kind: str, spec: str, name: str, geometry: KVGeometry, runtime, mib: int, repeats: int,
              directory: Path, console: Console) -> list[dict]:
    count = max(BATCH, (mib << 20) // geometry.bytes_per_page)
    namespace = Namespace(f"bench/{name}", geometry, "bfloat16", tenant=f"{os.getpid()}-{time.time_ns()}")
    keys = page_keys(namespace, np.arange(count * geometry.page_size))
    pool = HostPool.allocate(geometry, "page_first", pages=count * 2, kind="pinned", runtime=runtime)
    view = pool.buffer.as_tensor().numpy()
    view[:] = np.random.default_rng().integers(0, 256, view.size, dtype=np.uint8)
    del view
    nbytes = count * geometry.bytes_per_page
    store = open_store(spec, namespace)
    pages = HostPages(pool, store)                  # registered with the store (Mooncake: zero-copy)
    reference_memory = np.empty(nbytes, np.uint8)   # every other contender's destination
    rows: list[dict] = []
    try:
        with pages.batch(np.arange(count)) as source, pages.batch(np.arange(count, 2 * count)) as target:
            pieces = [source.pieces(i) for i in range(count)]
            into = [target.pieces(i) for i in range(count)]

            def kv_set() -> None:
                assert store.set(keys, pieces) == count, store.last_error

            def kv_get() -> None:
                assert store.get(keys, into) == count, store.last_error

            run = {"store": store, "keys": keys, "pieces": pieces, "into": into, "nbytes": nbytes,
                   "mirror": mirrored(pieces, reference_memory), "kv_set": kv_set, "kv_get": kv_get}
            kv_set()
            if store_kind == "file":
                rows += file_rows(run, name, repeats, directory)
            elif store_kind == "mooncake":
                rows += mooncake_rows(run, name, repeats)
            else:
                rows += redis_rows(run, spec, name, repeats, console)
            stats = store.stats()
            assert stats.get("errors.get", 0) == 0 and stats.get("errors.set", 0) == 0, store.last_error
            assert stats.get("bounced_pages", 0) == 0, "pages of a registered pool went through a copy"
    finally:
        with contextlib.suppress(Exception):          # a run that failed leaves nothing on a server it was given
            store.clear()
        store.close()
        pages.close()
        pool.close()
    return rows


# -- prefetch --------------------------------------------------------------------------------------------------------
def page_digest(pieces) -> bytes:
    digest = xxhash.xxh3_128()
    for piece in pieces:
        digest.update(piece)
    return digest.digest()


def check_pages(pool: HostPool, ids: np.ndarray, expected: list[bytes]) -> None:
    """Every page of the chain, in order, is in ``pool`` at ``ids`` with the bytes that were written (KVTIER_BENCH_
    PLANT=1: one byte of the last page corrupted first)."""
    if len(ids) != len(expected):
        raise Mismatch(f"prefetch: {len(ids)} pages in the host tier, {len(expected)} written")
    pages = HostPages(pool)
    try:
        with pages.batch(ids) as io_:
            if os.environ.get(PLANT) == "1":
                np.frombuffer(io_.pieces(len(ids) - 1)[-1], np.uint8)[-1] ^= 0xFF
            wrong = [i for i in range(len(ids)) if page_digest(io_.pieces(i)) != expected[i]]
    finally:
        pages.close()
    if wrong:
        raise Mismatch(f"prefetch: {len(wrong)} pages differ from the source (the first: page {wrong[0]})")


def prefetch_rows(store_kind: str, spec: str, runtime, tokens: int, directory: Path | None,
                  layout: str = "page_first") -> list[dict]:
    """Write a chain through one cache, then time a fresh cache's prefetch of it (warm and, for files, cold)."""
    geometry = SIZES["llama3-8b-p16"]
    pages = tokens // geometry.page_size
    namespace = Namespace("bench/prefetch", geometry, "bfloat16", tenant=f"{os.getpid()}-{time.time_ns()}")
    prompt = np.random.default_rng().integers(0, 128256, tokens)
    store = open_store(spec, namespace, layout=layout)
    rows = []
    try:
        writer = HostPool.allocate(geometry, layout, pages=pages, kind="pinned", runtime=runtime)
        view = writer.buffer.as_tensor().numpy()
        view[:] = np.random.default_rng().integers(0, 256, view.size, dtype=np.uint8)
        del view
        source = HostPages(writer)
        with source.batch(np.arange(pages)) as io_:
            store.set(page_keys(namespace, prompt), [io_.pieces(i) for i in range(pages)])
            expected = [page_digest(io_.pieces(i)) for i in range(pages)]
        source.close()
        writer.close()
        os.sync()                                          # no writeback of the chain under the timed read
        states = [("warm", None)]
        if store_kind == "file":
            states.append(("cold", lambda: drop_cache([store.path(k) for k in page_keys(namespace, prompt)])))  # type: ignore[attr-defined]
        for (state, before), pool_state in [(s, p) for s in states for p in ("touched", "fresh")]:
            if before:
                before()
            device = DevicePool.allocate(geometry, 64, 0, runtime=runtime)
            host = HostPool.allocate(geometry, layout, pages=pages + 64, kind="pinned", runtime=runtime)
            if pool_state == "touched":                  # as a serving process's pool is after its first backups
                memory = host.buffer.as_tensor().numpy()
                memory[:] = 1
                del memory
            cache = KVCache(device, host, namespace, CacheSettings(calibrate=False, io_backend="direct"),
                            storage=store)
            try:
                start = time.perf_counter()
                fetch = cache.prefetch(prompt)
                fetch.wait()
                seconds = time.perf_counter() - start
                assert fetch.outcome == "complete", fetch
                assert cache.match_prefix(prompt).host_tokens == tokens
                nbytes = pages * geometry.bytes_per_page
                match = cache.match_prefix(prompt)             # the bytes timed are the bytes written
                check_pages(host, np.concatenate([node.host for node in match.host_nodes]), expected)
                rows.append({"store": store_kind, "tokens": tokens, "cache": state, "layout": layout,
                             "host_pool": pool_state, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                             "bytes": nbytes, "verified": "every page's xxh3-128 against the written page's"})
            finally:
                cache.close()
                host.close()
                device.close()
        store.clear()
    finally:
        store.close()
    return rows


# -- the run ---------------------------------------------------------------------------------------------------------
def print_tables(console: Console, rows: list[dict], prefetches: list[dict], runtime_name: str) -> None:
    table = Table(title=f"kvtier storage — pages through kvtier vs its ceiling, same bytes, same run "
                        f"({os.cpu_count()} CPUs, runtime {runtime_name}); every byte of every contender checked")
    for column in ("store", "page", "op", "page cache", "kvtier GB/s", "ceiling", "ceiling GB/s", "% of ceiling"):
        table.add_column(column, justify="right" if "GB/s" in column or "%" in column else "left")
    for r in rows:
        table.add_row(r["store"], r["page"], r["op"], r["cache"], f"{r['gbps']:.2f}", r["ceiling"] or "none",
                      f"{r['ceiling_gbps']:.2f}" if r["ceiling_gbps"] else "", f"{r['pct']:.0f}%" if r["pct"] else "")
    console.print(table)
    table = Table(title="every reference of the same run (kvtier's % of each)")
    for column in ("store", "page", "op", "page cache", "reference", "role", "GB/s", "kvtier %"):
        table.add_column(column, justify="right" if "GB/s" in column or "%" in column else "left")
    for r in rows:
        for ref in r["references"]:
            table.add_row(r["store"], r["page"], r["op"], r["cache"], ref["name"], ref["role"], f"{ref['gbps']:.2f}",
                          f"{ref['kvtier_pct']:.0f}%" if ref["kvtier_pct"] else "")
    console.print(table)
    if prefetches:
        table = Table(title="prefetch of a chain into an empty host tier (Llama-3-8B, 16-token pages)")
        for column in ("store", "tokens", "host layout", "page cache", "host pool", "seconds", "GB/s"):
            table.add_column(column)
        for r in prefetches:
            table.add_row(r["store"], f"{r['tokens']:,}", r["layout"], r["cache"], r["host_pool"],
                          f"{r['seconds']:.3f}", f"{r['gbps']:.2f}")
        console.print(table)
    contenders = sum(1 + len(r["references"]) for r in rows)
    console.print(f"verified: every contender's bytes after every timed call ({contenders} contenders in {len(rows)} "
                  f"rows, {len(prefetches)} prefetch rows): no mismatch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="file,redis,mooncake",
                        type=name_list(["file", "redis", "mooncake"], "store"),
                        help="stores to measure, comma-separated (default: %(default)s)")
    parser.add_argument("--sizes", default=",".join(SIZES), type=name_list(SIZES, "size"),
                        help="page sizes to measure, comma-separated (default: %(default)s)")
    parser.add_argument("--redis", help="a Redis URL (default: start a private redis-server)")
    parser.add_argument("--mooncake", help="a mooncake:// spec (default: start a private Mooncake Store)")
    parser.add_argument("--dir", help="directory for the file store (default: a temporary one)")
    parser.add_argument("--mib", type=int, default=512, help="MiB of pages per row (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats, median reported (default: %(default)s)")
    parser.add_argument("--prefetch-tokens", type=int, default=32768,
                        help="tokens in the chain the prefetch rows read; 0 skips them (default: %(default)s)")
    parser.add_argument("--host-layouts", default="page_first",
                        type=name_list([x.value for x in HostLayout], "host layout"),
                        help="host pool layouts the prefetch rows read into, comma-separated (default: %(default)s)")
    parser.add_argument("--runtime", help="kvtier runtime of the pools (default: kvtier's choice)")
    parser.add_argument("--json", help="write the results here (default: none)")
    args = parser.parse_args()
    runtime = get_runtime(args.runtime)
    console = Console(width=None if sys.stdout.isatty() else 220)   # whole rows in saved output
    directory = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-bench-store-"))
    started = None
    mooncake_dir: Path | None = None
    specs = {}
    rows, prefetches = [], []
    try:
        for kind in args.stores:
            if kind == "file":
                specs[kind] = f"file:{directory / 'store'}"
            elif kind == "redis":
                if args.redis:
                    specs[kind] = args.redis
                else:
                    started = start_redis()
                    if started is None:
                        console.print("[yellow]no redis-server installed: skipping the redis rows")
                        continue
                    specs[kind] = started[0]
            elif kind == "mooncake":
                spec = args.mooncake or start_mooncake(directory / "mooncake")
                if spec is None:
                    console.print("[yellow]the Mooncake wheel is not installed: skipping the mooncake rows")
                    continue
                mooncake_dir = None if args.mooncake else directory / "mooncake"
                specs[kind] = spec
        for kind, spec in specs.items():
            for name in args.sizes:
                rows += page_rows(kind, spec, name, SIZES[name], runtime, args.mib, args.repeats, directory, console)
                console.print(f"{kind} {name}: done")
            if args.prefetch_tokens:
                for layout in args.host_layouts:
                    prefetches += prefetch_rows(kind, spec, runtime, args.prefetch_tokens, directory, layout)
    except Mismatch as mismatch:
        print(f"storage.py: verification failed: {mismatch}", file=sys.stderr)
        return 1
    finally:
        if started is not None:
            stop_redis(started)
        if mooncake_dir is not None:
            stop_mooncake(mooncake_dir)
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    print_tables(console, rows, prefetches, runtime.name)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"cpus": os.cpu_count(), "runtime": runtime.name, "verified": True, "rows": rows,
                       "prefetch": prefetches}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
