"""SGLang HiCache L3 storage benchmark: ``batch_set_v1`` / ``batch_get_v1`` of a long prefix through kvtier's backend
(``KVTierStorage``, built by SGLang's own factory as ``dynamic``) over kvtier's stores, beside SGLang's own backends
on the same pages, with the same keys, in the same run.

The prefix: ``--tokens`` tokens (default 32k) of Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB a
token, 4 GiB for 32k) in SGLang's real ``MHATokenToKVPoolHost`` (``--layout``, default ``page_first``; page size
``--page-size``, default 64: 8 MiB pages). The pool holds the prefix twice: the source pages (random bytes, never
zeros) and as many destination slots, which every get reads into (poisoned before each get). Every backend is driven
in SGLang's storage batches (``STORAGE_BATCH_SIZE`` = 128 pages a call), one call after the other, as the cache
controller's backup and prefetch threads call it.

Rows, per store (each only where it is available):

- **kvtier** (``file:``, ``redis://``, ``mooncake://``): ``KVTierStorage`` from ``StorageBackendFactory.create_backend(
  "dynamic", …)`` with ``interface_v1`` (``batch_set_v1`` / ``batch_get_v1``, zero-copy from and into the pool);
  every page read is verified (header fields + xxh3-128 of the payload) before it counts.
- **SGLang file**: SGLang's ``HiCacheFile`` (``create_backend("file", …)``), which has no v1 methods, driven as the
  controller drives such a backend (``_generic_page_set`` / ``_generic_page_get``): ``batch_set(keys,
  [get_data_page(i)…])``; ``batch_get(keys, [get_dummy_flat_data_page()…])`` then ``set_from_flat_data_page`` per page.
  A page file is raw bytes: nothing is checked on read.
- **SGLang mooncake**: SGLang's ``MooncakeStore`` (``create_backend("mooncake", …)``) on the same Mooncake master as
  kvtier, over loopback TCP, lending no memory (``global_segment_size`` 0, as kvtier's client): both write to the
  same segment holder. Its ``batch_set_v1`` / ``batch_get_v1`` are zero-copy (K and V of a page as two objects);
  nothing is checked on read. Not supported by SGLang for ``layer_first`` MHA pools (it says so; the row says why).
- **ceiling**, same pages, same run: *file*: one plain file in the same directory, written with ``write`` per page
  piece and read back with ``readinto`` into the destination pieces (page cache, no header, checksum, temporary file
  or rename). *redis*: redis-py's pipelined ``SET`` of each page piece straight from the pool (no copy) and ``GET``
  copied into the destination pieces, 32 pages a pipeline as kvtier's store: bound by the one-threaded redis-server
  and redis-py's reply parsing on loopback TCP. *mooncake*: Mooncake's own ``batch_put_from`` / ``batch_get_into``
  on a client of its own, an object per page piece (K and V apart: the calls SGLang's backend makes, without its
  existence check), 128 pages a call: bound by Mooncake's TCP transport on loopback (its threads and the copies
  through the socket share the cores with the caller). A reference row beside it: Mooncake's multi-buffer calls with
  an object per page of its pieces, kvtier's transfer shape without kvtier's header slot, existence check or checksum.

Fair play: every timed set writes keys no store holds yet (fresh SGLang keys per repeat, the same keys for every
backend of a repeat; a backend's pages are deleted, untimed, before the next backend runs), so no backend skips a page
as "already stored"; kvtier's existence check (``skip_existing``) and SGLang's own (``exists`` / ``batch_is_exist``)
stay in the timed calls, as in serving. File rows: ``os.sync()`` before each timed call (no writeback of an earlier
write under it). One warm-up round first (dropped), then ``--repeats`` timed rounds, the backends' order rotated each
round; median and worst reported, and beside them the CPU seconds per GB of this process (every thread) and of
the servers the run started. After the timed rounds each backend reads its pages once more into poisoned
destination slots, and every byte is compared with the source: a mismatch or a page a backend could not read fails
the run (exit status 1).

Usage: python bench/sglang_storage.py [--stores file,redis,mooncake] [--tokens 32768] [--layout page_first]
       [--redis URL] [--mooncake SPEC] [--dir PATH] [--json PATH]
Without ``--redis`` a private redis-server is started when one is installed; without ``--mooncake`` a private
Mooncake Store (``scripts/mooncake_servers.sh``) when the Mooncake wheel is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))                 # helpers.sglang_pools: SGLang's host pools on the CPU

from _options import name_list  # noqa: E402
from _servers import start_mooncake, start_redis, stop_mooncake, stop_redis  # noqa: E402

STORES = ("file", "redis", "mooncake")
SGLANG_BACKENDS = ("file", "mooncake")
LAYOUTS = ("page_first", "layer_first", "page_first_direct")
LLAMA3_8B = {"layers": 32, "heads": 8, "head_dim": 128}
PIPELINE_PAGES = 32
"""Pages per Redis pipeline of the Redis ceiling (kvtier's store batches 32 pages too)."""
CHECK_PAGES = 16
"""Pages compared at a time after the timed rounds (two copies of this many pages in memory)."""
RAW = "kvtier-bench-raw"


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class BenchFailure(Exception):
    """A backend failed a call, read other bytes than were written, or could not be set up when asked for."""


@dataclass
class Pages:
    """The prefix: SGLang's host pool, its source and destination slots, and the pages' pieces (for the ceilings)."""

    pool: Any
    pages: int
    page_size: int
    source: Any                       # torch int64 tensor of host indices, page_size per page
    target: Any
    source_pieces: list[list[memoryview]]
    target_pieces: list[list[memoryview]]
    source_addresses: list[list[int]]
    target_addresses: list[list[int]]

    @property
    def page_bytes(self) -> int:
        return sum(p.nbytes for p in self.source_pieces[0])

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes


def piece_views(pool: Any, indices: Any, pages: int) -> tuple[list[list[memoryview]], list[list[int]]]:
    """Each page's pieces as SGLang's pool lists them (``get_page_buffer_meta``): byte views of the pool, and their
    addresses."""
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    per = len(ptrs) // pages
    views = [memoryview((ctypes.c_ubyte * int(n)).from_address(int(p))).cast("B") for p, n in zip(ptrs, sizes,
                                                                                                   strict=True)]
    addresses = [int(p) for p in ptrs]
    return ([views[i * per:(i + 1) * per] for i in range(pages)],
            [addresses[i * per:(i + 1) * per] for i in range(pages)])


TOKEN_BYTES = 2 * LLAMA3_8B["layers"] * LLAMA3_8B["heads"] * LLAMA3_8B["head_dim"] * 2   # K and V, bf16
HEADROOM = 2 << 30
"""Memory beside the host pool: SGLang's flat pages of one storage batch (its file backend's get and set hold 128)."""


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def build_pages(sp: Any, torch: Any, layout: str, tokens: int, page_size: int) -> Pages:
    """SGLang's host pool of ``2 * tokens`` slots, booked with SGLang's own host-memory check against what it takes
    (checked here first against the machine's available memory), the source pages filled."""
    pages = tokens // page_size
    nbytes = 2 * tokens * TOKEN_BYTES
    free = available_bytes()
    if free is not None and nbytes + HEADROOM > free:
        raise BenchFailure(f"the host pool takes {nbytes / 2**30:.1f} GiB (twice the {tokens:,} tokens' KV) and "
                           f"{HEADROOM / 2**30:.0f} GiB beside it; {free / 2**30:.1f} GiB are available: use a "
                           f"smaller --tokens")
    pool = sp.mha_host_pool(layout, **LLAMA3_8B, page_size=page_size, tokens=page_size, dtype=torch.bfloat16,
                            host_tokens=2 * tokens, budget=nbytes)
    source = torch.arange(0, tokens, dtype=torch.int64)
    target = torch.arange(tokens, 2 * tokens, dtype=torch.int64)
    step = CHECK_PAGES * page_size
    for at in range(0, tokens, step):
        sp.fill_pages(pool, source[at:at + step], seed=at)
        sp.poison_pages(pool, target[at:at + step])
    (source_pieces, source_addresses), (target_pieces, target_addresses) = (piece_views(pool, source, pages),
                                                                            piece_views(pool, target, pages))
    return Pages(pool, pages, page_size, source, target, source_pieces, target_pieces, source_addresses,
                 target_addresses)


def poison(sp: Any, prefix: Pages) -> None:
    step = CHECK_PAGES * prefix.page_size
    for at in range(0, prefix.pages * prefix.page_size, step):
        sp.poison_pages(prefix.pool, prefix.target[at:at + step])


def wrong_pages(sp: Any, torch: Any, prefix: Pages) -> list[int]:
    """The pages whose destination slots differ from their source slots in any byte."""
    wrong = []
    step = CHECK_PAGES * prefix.page_size
    for at in range(0, prefix.pages * prefix.page_size, step):
        want = sp.page_slots(prefix.pool, prefix.source[at:at + step])
        got = sp.page_slots(prefix.pool, prefix.target[at:at + step])
        if not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
            first = at // prefix.page_size
            for page in range(first, min(first + CHECK_PAGES, prefix.pages)):
                one = slice(page * prefix.page_size, (page + 1) * prefix.page_size)
                if not all(torch.equal(a, b) for a, b in zip(sp.page_slots(prefix.pool, prefix.source[one]),
                                                             sp.page_slots(prefix.pool, prefix.target[one]),
                                                             strict=True)):
                    wrong.append(page)
    return wrong


def sglang_keys(run: str, store: str, round_: int, pages: int) -> list[str]:
    """SGLang-style page keys (64 hex digits, as its SHA-256 chain makes them), fresh per store and round."""
    return [hashlib.sha256(f"{run}:{store}:{round_}:{i}".encode()).hexdigest() for i in range(pages)]


# -- the backends -----------------------------------------------------------------------------------------------------
@dataclass
class Runner:
    """One row: how to set and get the prefix's pages under keys, and to delete them (untimed)."""

    store: str
    name: str
    checks: str                                   # what it checks of a page it reads
    set: Callable[[list[str]], None]
    get: Callable[[list[str]], None]
    delete: Callable[[list[str]], None]
    close: Callable[[], None] = lambda: None
    role: str = "backend"                          # backend, ceiling or reference
    set_s: list[float] = field(default_factory=list)
    get_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, list[float]] = field(default_factory=lambda: {"set": [], "get": []})
    server_cpu_s: dict[str, list[float]] = field(default_factory=lambda: {"set": [], "get": []})
    verified: bool | None = None


def batches(prefix: Pages, batch: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + batch, prefix.pages)) for lo in range(0, prefix.pages, batch)]


def v1_runner(store: str, name: str, checks: str, backend: Any, prefix: Pages, batch: int, extra: Any,
              delete: Callable[[list[str]], None], close: Callable[[], None] = lambda: None) -> Runner:
    """A backend with SGLang's zero-copy interface, called as the controller's ``_page_set_zero_copy`` /
    ``_page_get_zero_copy`` call it: a batch of keys and their host indices at a time."""
    ps = prefix.page_size
    parts = batches(prefix, batch)

    def call(method: Callable[..., list[bool]], keys: list[str], indices: Any, what: str) -> None:
        for lo, hi in parts:
            done = method(keys[lo:hi], indices[lo * ps:hi * ps], extra)
            if not all(done):
                raise BenchFailure(f"{store} {name}: {what} of pages {lo}..{hi - 1}: "
                                   f"{sum(1 for d in done if not d)} of {hi - lo} failed")

    return Runner(store, name, checks, lambda keys: call(backend.batch_set_v1, keys, prefix.source, "batch_set_v1"),
                  lambda keys: call(backend.batch_get_v1, keys, prefix.target, "batch_get_v1"), delete, close)


def generic_runner(store: str, name: str, backend: Any, prefix: Pages, batch: int,
                   delete: Callable[[list[str]], None]) -> Runner:
    """A backend without the v1 interface (SGLang's ``HiCacheFile``), called as the controller's
    ``_generic_page_set`` / ``_generic_page_get`` call it: flat page tensors, copied into the pool one by one."""
    pool, ps = prefix.pool, prefix.page_size
    parts = batches(prefix, batch)

    def set_pages(keys: list[str]) -> None:
        for lo, hi in parts:
            data = [pool.get_data_page(prefix.source[i * ps]) for i in range(lo, hi)]
            if not backend.batch_set(keys[lo:hi], data):
                raise BenchFailure(f"{store} {name}: batch_set of pages {lo}..{hi - 1} failed")

    def get_pages(keys: list[str]) -> None:
        for lo, hi in parts:
            dummy = [pool.get_dummy_flat_data_page() for _ in range(lo, hi)]
            data = backend.batch_get(keys[lo:hi], dummy)
            for i, page in enumerate(data or [None] * (hi - lo)):
                if page is None:
                    raise BenchFailure(f"{store} {name}: batch_get missed page {lo + i}")
                pool.set_from_flat_data_page(prefix.target[(lo + i) * ps], page)

    return Runner(store, name, "nothing", set_pages, get_pages, delete)


def file_ceiling(directory: Path, prefix: Pages) -> Runner:
    path = directory / f"plain-{uuid.uuid4().hex[:8]}.bin"

    def set_pages(keys: list[str]) -> None:
        with open(path, "wb", buffering=0) as file:
            for pieces in prefix.source_pieces:
                for piece in pieces:
                    file.write(piece)

    def get_pages(keys: list[str]) -> None:
        with open(path, "rb", buffering=0) as file:
            for pieces in prefix.target_pieces:
                for piece in pieces:
                    if file.readinto(piece) != piece.nbytes:
                        raise BenchFailure(f"file ceiling: short read of {path}")

    return Runner("file", "plain file (ceiling)", "nothing", set_pages, get_pages,
                  lambda keys: path.unlink(missing_ok=True), role="ceiling")


def redis_ceiling(url: str, prefix: Pages) -> Runner:
    import redis

    client = redis.Redis.from_url(url)
    parts = batches(prefix, PIPELINE_PAGES)

    def names(keys: list[str], lo: int, hi: int) -> list[str]:
        return [f"{RAW}:{keys[i]}:{j}" for i in range(lo, hi) for j in range(len(prefix.source_pieces[i]))]

    def set_pages(keys: list[str]) -> None:
        for lo, hi in parts:
            pipe = client.pipeline(transaction=False)
            for name, piece in zip(names(keys, lo, hi), (p for i in range(lo, hi) for p in prefix.source_pieces[i]),
                                   strict=True):
                pipe.set(name, piece)
            pipe.execute()

    def get_pages(keys: list[str]) -> None:
        for lo, hi in parts:
            pipe = client.pipeline(transaction=False)
            for name in names(keys, lo, hi):
                pipe.get(name)
            for blob, piece in zip(pipe.execute(), (p for i in range(lo, hi) for p in prefix.target_pieces[i]),
                                   strict=True):
                if blob is None or len(blob) != piece.nbytes:
                    raise BenchFailure("redis ceiling: a piece is missing")
                piece[:] = blob

    def delete(keys: list[str]) -> None:
        for lo, hi in parts:
            client.delete(*names(keys, lo, hi))

    return Runner("redis", "redis-py pipeline (ceiling)", "nothing", set_pages, get_pages, delete, client.close,
                  role="ceiling")


def quiet_mooncake_setup() -> Any:
    """A Mooncake client's set-up, without the lines it prints on stderr every time (its first look-up of itself):
    kvtier's own filter, as kvtier's store sets up its clients."""
    from kvtier.storage.mooncake import _benign_lines_dropped

    return _benign_lines_dropped()


def mooncake_ceiling(spec: str, prefix: Pages, batch: int) -> list[Runner]:
    """Mooncake's own calls on a client of its own, the pool registered with it, ``batch`` pages a call: the
    ceiling, ``batch_put_from`` / ``batch_get_into`` with an object per page piece (K and V apart: the calls
    SGLang's backend makes, without its existence check); and for reference the multi-buffer calls with an object
    per page of its pieces (kvtier's transfer shape, without kvtier's header slot, existence check or checksum)."""
    from mooncake.store import MooncakeDistributedStore

    from kvtier.storage.mooncake_url import parse_mooncake_url

    target = parse_mooncake_url(spec)
    client = MooncakeDistributedStore()
    with quiet_mooncake_setup():
        code = client.setup(target.local_hostname or "127.0.0.1", target.metadata, 0, 16 << 20, target.protocol,
                            target.device, target.master)
    if code != 0:
        raise BenchFailure(f"mooncake ceiling: setup of a Mooncake client failed: {code}")
    buffer = prefix.pool.kv_buffer
    base, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if client.register_buffer(base, size) != 0:
        raise BenchFailure("mooncake ceiling: register_buffer of the host pool failed")
    parts = batches(prefix, batch)
    sizes = [[p.nbytes for p in pieces] for pieces in prefix.source_pieces]
    per = len(sizes[0])

    def objects(keys: list[str], lo: int, hi: int) -> list[str]:
        return [f"{RAW}:{keys[i]}:{j}" for i in range(lo, hi) for j in range(per)]

    def flat(rows: list[list[int]]) -> list[int]:
        return [x for row in rows for x in row]

    def check(call: str, codes: list[int], good: Callable[[int, int], bool], want: list[int]) -> None:
        if not all(good(c, w) for c, w in zip(codes, want, strict=True)):
            raise BenchFailure(f"mooncake ceiling: {call}: {sorted(set(codes))}")

    def put(keys: list[str]) -> None:
        for lo, hi in parts:
            want = flat(sizes[lo:hi])
            check("batch_put_from", client.batch_put_from(objects(keys, lo, hi), flat(prefix.source_addresses[lo:hi]),
                                                          want), lambda c, w: c == 0, want)

    def get(keys: list[str]) -> None:
        for lo, hi in parts:
            want = flat(sizes[lo:hi])
            check("batch_get_into", client.batch_get_into(objects(keys, lo, hi), flat(prefix.target_addresses[lo:hi]),
                                                          want), lambda c, w: c == w, want)

    def put_pages(keys: list[str]) -> None:
        for lo, hi in parts:
            check("batch_put_from_multi_buffers", client.batch_put_from_multi_buffers(
                [f"{RAW}:{k}" for k in keys[lo:hi]], prefix.source_addresses[lo:hi], sizes[lo:hi]),
                lambda c, w: c == 0, [0] * (hi - lo))

    def get_pages(keys: list[str]) -> None:
        for lo, hi in parts:
            check("batch_get_into_multi_buffers", client.batch_get_into_multi_buffers(
                [f"{RAW}:{k}" for k in keys[lo:hi]], prefix.target_addresses[lo:hi], sizes[lo:hi]),
                lambda c, w: c == w, [prefix.page_bytes] * (hi - lo))

    def close() -> None:
        client.unregister_buffer(base)
        client.close()

    return [Runner("mooncake", "Mooncake batch_put_from / batch_get_into (ceiling)", "nothing", put, get,
                   lambda keys: client.batch_remove(objects(keys, 0, len(keys)), True), close, role="ceiling"),
            Runner("mooncake", "Mooncake multi-buffer, a page an object", "nothing", put_pages, get_pages,
                   lambda keys: client.batch_remove([f"{RAW}:{k}" for k in keys], True), role="reference")]


# -- the run ----------------------------------------------------------------------------------------------------------
def cpu_seconds(pids: list[int]) -> float | None:
    """CPU seconds (user + system) the processes ``pids`` used so far (from /proc), or None where one cannot be read."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def time_rounds(sp: Any, torch: Any, prefix: Pages, store: str, runners: list[Runner], repeats: int, run: str,
                settle: bool, server_pids: list[int]) -> list[str]:
    """One warm-up round and ``repeats`` timed rounds of every runner (order rotated per round), each a set then a
    get of fresh keys; then the final check of each runner's pages. Returns the failures (one line each). Beside
    each timed call's seconds: the CPU seconds of this process (every thread: the caller's, the stores' I/O and
    transfer threads, Mooncake's) and of the server processes this run started (``server_pids``)."""
    failures: list[str] = []
    live = list(runners)
    for round_ in range(repeats + 1):
        keys = sglang_keys(run, store, round_, prefix.pages)
        last = round_ == repeats
        order = live[round_ % len(live):] + live[:round_ % len(live)] if live else []
        for runner in order:
            try:
                for op, times in (("set", runner.set_s), ("get", runner.get_s)):
                    if op == "get":
                        poison(sp, prefix)
                    if settle:
                        os.sync()
                    cpu, server = own_cpu_seconds(), cpu_seconds(server_pids) if server_pids else None
                    start = time.perf_counter()
                    (runner.set if op == "set" else runner.get)(keys)
                    seconds = time.perf_counter() - start
                    cpu = own_cpu_seconds() - cpu
                    server_after = cpu_seconds(server_pids) if server is not None else None
                    if round_:
                        times.append(seconds)
                        runner.cpu_s[op].append(cpu)
                        if server is not None and server_after is not None:
                            runner.server_cpu_s[op].append(server_after - server)
                    progress(f"  {store} {runner.name}: {op} {'warm-up' if not round_ else f'{round_}/{repeats}'} "
                             f"{seconds:.3f} s ({prefix.nbytes / seconds / 1e9:.2f} GB/s)")
                if last:
                    poison(sp, prefix)
                    runner.get(keys)
                    wrong = wrong_pages(sp, torch, prefix)
                    runner.verified = not wrong
                    if wrong:
                        failures.append(f"{store} {runner.name}: {len(wrong)} of {prefix.pages} pages read back "
                                        f"differ from what was written (first: page {wrong[0]})")
                    else:
                        progress(f"  {store} {runner.name}: all {prefix.pages} pages read back byte for byte")
            except BenchFailure as failure:
                failures.append(str(failure))
                runner.verified = False
                live.remove(runner)
            finally:
                with contextlib.suppress(Exception):
                    runner.delete(keys)
    return failures


def summary(runner: Runner, nbytes: int) -> dict[str, Any]:
    def rates(times: list[float]) -> tuple[float | None, float | None]:
        if not times:
            return None, None
        return nbytes / statistics.median(times) / 1e9, nbytes / max(times) / 1e9

    def per_gb(seconds: list[float]) -> float | None:
        return statistics.median(seconds) / (nbytes / 1e9) if seconds else None

    set_gbps, set_worst = rates(runner.set_s)
    get_gbps, get_worst = rates(runner.get_s)
    return {"store": runner.store, "backend": runner.name, "checks_on_read": runner.checks, "role": runner.role,
            "set_s": runner.set_s, "get_s": runner.get_s, "set_gbps": set_gbps, "set_gbps_worst": set_worst,
            "get_gbps": get_gbps, "get_gbps_worst": get_worst, "verified": runner.verified,
            "cpu_s": runner.cpu_s, "server_cpu_s": runner.server_cpu_s,
            **{f"{op}_cpu_s_per_gb": per_gb(runner.cpu_s[op]) for op in ("set", "get")},
            **{f"{op}_server_cpu_s_per_gb": per_gb(runner.server_cpu_s[op]) for op in ("set", "get")}}


def ratio(rows: list[dict], store: str, mine: str, theirs: str, op: str) -> float | None:
    found = {r["backend"]: r for r in rows if r["store"] == store}
    a, b = found.get(mine, {}).get(f"{op}_gbps"), found.get(theirs, {}).get(f"{op}_gbps")
    return a / b if a and b else None


GOALS = (("file", "SGLang file", 1.0), ("mooncake", "SGLang mooncake", 0.9))


def variant(text: str) -> tuple[str, dict[str, Any]]:
    """An argparse ``type``: ``STORE:JSON`` -> (store, options)."""
    store, _, options = text.partition(":")
    if store not in STORES:
        raise argparse.ArgumentTypeError(f"unknown store {store!r} in {text!r} (choose from {', '.join(STORES)})")
    try:
        parsed = json.loads(options)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: after STORE: a JSON object of options ({exc})") from None
    if not isinstance(parsed, dict) or not parsed:
        raise argparse.ArgumentTypeError(f"{text!r}: after STORE: a non-empty JSON object of options")
    return store, parsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default=",".join(STORES), type=name_list(STORES, "store"),
                        help="kvtier stores to measure, comma-separated; each is skipped with a note where it is not "
                             "available (default: %(default)s)")
    parser.add_argument("--sglang", default=",".join(SGLANG_BACKENDS), type=name_list(SGLANG_BACKENDS, "backend"),
                        help="SGLang's own backends to run beside kvtier's, for the stores measured "
                             "(default: %(default)s)")
    parser.add_argument("--no-sglang", action="store_true", help="run none of SGLang's own backends")
    parser.add_argument("--tokens", type=int, default=32768,
                        help="tokens of the prefix (Llama-3-8B: 128 KiB each); 1024 is a quick run "
                             "(default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (default: %(default)s)")
    parser.add_argument("--layout", default="page_first", choices=LAYOUTS,
                        help="SGLang host pool layout (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds after one warm-up round; median and worst reported (default: %(default)s)")
    parser.add_argument("--redis", help="a Redis URL (default: start a private redis-server)")
    parser.add_argument("--mooncake", help="a mooncake:// spec (default: start a private Mooncake Store)")
    parser.add_argument("--mooncake-segment", default="8 GB",
                        help="memory the private Mooncake Store's segment holder lends (default: %(default)s)")
    parser.add_argument("--dir", help="directory for the file stores and the ceiling's file (default: a temporary "
                                      "one, removed at the end)")
    parser.add_argument("--kvtier-variant", action="append", default=[], type=variant, metavar="STORE:JSON",
                        help="one more kvtier row for STORE, with these extra-config options (as a deployment writes "
                             "them in --hicache-storage-backend-extra-config), e.g. "
                             "'mooncake:{\"store_options\": {\"batch_pages\": 128}}'; repeatable (default: none)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.tokens < 1 or args.page_size < 1 or args.tokens % args.page_size:
        parser.error(f"--tokens {args.tokens}: a positive multiple of --page-size {args.page_size}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    try:
        return run(args)
    except BenchFailure as failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")   # Mooncake clients' INFO lines, a dozen each
    import helpers.sglang_pools as sp

    sp.place_torchvision()                           # before anything imports transformers (helpers/sglang_pools.py)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # SGLang's import-time notes about GPU-only quantizations
        try:
            sp.import_host_pools()
        except sp.SGLangMissing as missing:
            raise BenchFailure(f"{missing} (this benchmark runs SGLang's own host pool and backends)") from None
    import torch
    from rich.console import Console
    from rich.table import Table
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvtier.integrations.sglang import page_key

    console = Console(width=None if sys.stdout.isatty() else 160)   # whole rows in the saved output
    sglang_backends = [] if args.no_sglang else args.sglang
    run_id = uuid.uuid4().hex
    load_before = [round(x, 2) for x in os.getloadavg()]
    notes: list[str] = []
    unavailable: list[dict[str, str]] = []
    failures: list[str] = []
    rows: list[dict[str, Any]] = []
    started_redis = None
    mooncake_dir: Path | None = None
    progress(f"building SGLang's MHATokenToKVPoolHost ({args.layout}, {args.tokens:,} tokens x 2, page size "
             f"{args.page_size}) and filling the source pages")
    prefix = build_pages(sp, torch, args.layout, args.tokens, args.page_size)
    extra = HiCacheStorageExtraInfo()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-bench-sglang-"))   # removed below unless given
    directory.mkdir(parents=True, exist_ok=True)
    try:
        for store in args.stores:
            spec = None
            if store == "file":
                spec = f"file:{directory / 'kvtier'}"
            elif store == "redis":
                if args.redis:
                    spec = args.redis
                else:
                    started_redis = start_redis()
                    if started_redis is None:
                        notes.append("redis: no redis-server installed and no --redis URL: not measured")
                        continue
                    spec = started_redis[0]
            else:
                spec = args.mooncake
                if spec is None:
                    mooncake_dir = directory / "mooncake"
                    spec = start_mooncake(mooncake_dir, args.mooncake_segment)
                    if spec is None:
                        mooncake_dir = None
                        notes.append("mooncake: the Mooncake wheel is not installed and no --mooncake spec: not "
                                     "measured")
                        continue
            server_pids: list[int] = []                # the servers this run started: their CPU time is measured
            if store == "redis" and started_redis is not None:
                server_pids = [started_redis[1].pid]
            elif store == "mooncake" and mooncake_dir is not None:
                server_pids = [int((mooncake_dir / f"{name}.pid").read_text()) for name in ("holder", "master")]
            progress(f"{store}: setting up the backends")
            runners: list[Runner] = []
            for label, options in [("kvtier", {})] + [(f"kvtier {json.dumps(o, separators=(',', ':'))}", o)
                                                      for where, o in args.kvtier_variant if where == store]:
                kv = sp.create_backend(spec, prefix.pool, config=sp.storage_config(), **options)
                runners.append(v1_runner(store, label, "header + xxh3-128", kv, prefix, STORAGE_BATCH_SIZE, extra,
                                         lambda keys, kv=kv: kv.store.delete([page_key(k) for k in keys]), kv.close))
            if store == "file":
                runners.append(file_ceiling(directory, prefix))
                if "file" in sglang_backends:
                    own = directory / "sglang-file"
                    if os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"):
                        notes.append("SGLang file: SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR is set and wins over "
                                     "the directory given here")
                    file_config = sp.storage_config()
                    file_config.extra_config = {"file_storage_path": str(own)}
                    backend = sp.create_sglang_backend("file", file_config, prefix.pool)
                    runners.append(generic_runner(store, "SGLang file", backend, prefix, STORAGE_BATCH_SIZE,
                                                  lambda keys, b=backend: b.clear()))
            elif store == "redis":
                runners.append(redis_ceiling(spec, prefix))
                notes.append(f"redis: SGLang has no Redis backend of its own (its factory registers "
                             f"{', '.join(sorted(StorageBackendFactory._registry))}): kvtier against the ceiling "
                             f"only")
            else:
                try:
                    runners += mooncake_ceiling(spec, prefix, STORAGE_BATCH_SIZE)
                except BenchFailure as failure:
                    unavailable.append({"store": store, "backend": "Mooncake ceiling", "reason": str(failure)})
                if "mooncake" in sglang_backends:
                    runner = sglang_mooncake(sp, spec, prefix, STORAGE_BATCH_SIZE, extra)
                    if isinstance(runner, str):
                        unavailable.append({"store": store, "backend": "SGLang mooncake", "reason": runner})
                        progress(f"  SGLang mooncake: not measured: {runner}")
                    else:
                        runners.append(runner)
            try:
                failures += time_rounds(sp, torch, prefix, store, runners, args.repeats, run_id,
                                        settle=store == "file", server_pids=server_pids)
            finally:
                for runner in runners:
                    with contextlib.suppress(Exception):
                        runner.close()
            rows += [summary(r, prefix.nbytes) for r in runners]
            if started_redis is not None:
                stop_redis(started_redis)
                started_redis = None
            if mooncake_dir is not None:
                stop_mooncake(mooncake_dir)
                mooncake_dir = None
    finally:
        if started_redis is not None:
            stop_redis(started_redis)
        if mooncake_dir is not None:
            stop_mooncake(mooncake_dir)
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)

    machine = {"cpus": os.cpu_count(), "load_avg_before": load_before,
               "load_avg_after": [round(x, 2) for x in os.getloadavg()],
               "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    ceilings = {r["store"]: r for r in rows if r["role"] == "ceiling"}
    table = Table(title=f"SGLang HiCache L3 storage: {args.tokens:,} tokens of Llama-3-8B ({prefix.nbytes / 2**30:.2f} "
                        f"GiB, {prefix.pages} pages of {prefix.page_bytes / 2**20:g} MiB, {args.layout}), median "
                        f"(worst) of {args.repeats}, {machine['cpus']} CPUs, load {load_before[0]} -> "
                        f"{machine['load_avg_after'][0]}")
    for column in ("store", "backend", "checks each page read", "set GB/s", "% ceiling", "get GB/s", "% ceiling ",
                   "CPU s/GB set / get", "server's"):
        table.add_column(column, justify="left" if column in ("store", "backend", "checks each page read") else "right")

    def cpu_cells(row: dict) -> tuple[str, str]:
        def pair(key: str) -> str:
            values = [row[f"{op}_{key}"] for op in ("set", "get")]
            return "" if None in values else f"{values[0]:.2f} / {values[1]:.2f}"
        return pair("cpu_s_per_gb"), pair("server_cpu_s_per_gb")


    def cell(row: dict, op: str) -> tuple[str, str]:
        if row[f"{op}_gbps"] is None:
            return "-", ""
        top = ceilings.get(row["store"], {}).get(f"{op}_gbps")
        pct = "" if row["role"] == "ceiling" or not top else f"{100 * row[f'{op}_gbps'] / top:.0f}%"
        return f"{row[f'{op}_gbps']:.2f} ({row[f'{op}_gbps_worst']:.2f})", pct

    for r in rows:
        table.add_row(r["store"], r["backend"], r["checks_on_read"], *cell(r, "set"), *cell(r, "get"), *cpu_cells(r))
    for u in unavailable:
        table.add_row(u["store"], u["backend"], "", "not measured", "", "", "", "", "")
    console.print(table)
    goals = []
    for store, theirs, goal in GOALS:
        if not any(r["store"] == store and r["backend"] == theirs for r in rows):
            continue
        for mine in [r["backend"] for r in rows if r["store"] == store and r["backend"].startswith("kvtier")]:
            found = {op: ratio(rows, store, mine, theirs, op) for op in ("set", "get")}
            met = all(v is not None and v >= goal for v in found.values())
            goals.append({"store": store, "backend": mine, "against": theirs, "goal": goal,
                          **{f"{op}_ratio": v for op, v in found.items()}, "met": met})
            console.print(f"{mine} / {theirs}: set {found['set'] or 0:.2f}x, get {found['get'] or 0:.2f}x "
                          f"(goal >= {goal}x each): {'met' if met else 'MISSED'}")
    for u in unavailable:
        console.print(f"{u['store']}: {u['backend']} not measured: {u['reason']}")
    for note in notes:
        console.print(note)
    console.print("kvtier verifies every page it reads (header fields and an xxh3-128 checksum of the payload) "
                  "before it counts; SGLang's file and mooncake backends and the ceilings check nothing.")
    console.print("CPU s/GB: median CPU seconds per GB moved, of this process (every thread, the kernel's work for "
                  "it included) and of the servers this run started (redis-server; Mooncake's segment holder and "
                  "master). Where the CPUs are shared with other work, GB/s follows these.")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": machine, "tokens": args.tokens, "page_size": args.page_size, "layout": args.layout,
                       "pages": prefix.pages, "page_bytes": prefix.page_bytes, "bytes": prefix.nbytes,
                       "repeats": args.repeats, "storage_batch_pages": STORAGE_BATCH_SIZE, "versions": versions(),
                       "rows": rows, "unavailable": unavailable, "goals": goals, "notes": notes,
                       "failures": failures}, file, indent=1)
    if failures:
        for failure in failures:
            print(f"FAILED: {failure}", file=sys.stderr)
        return 1
    return 0


def sglang_mooncake(sp: Any, spec: str, prefix: Pages, batch: int, extra: Any) -> Runner | str:
    """SGLang's own ``MooncakeStore`` on the same master as kvtier's store, or why it cannot run here."""
    from kvtier.storage.mooncake_url import parse_mooncake_url

    target = parse_mooncake_url(spec)
    config = sp.storage_config()
    config.extra_config = {"master_server_address": target.master, "metadata_server": target.metadata,
                           "protocol": target.protocol, "device_name": target.device,
                           "local_hostname": target.local_hostname or "127.0.0.1",
                           "global_segment_size": 0}     # lends nothing, as kvtier's client: one segment holder
    try:
        with quiet_mooncake_setup():
            backend = sp.create_sglang_backend("mooncake", config, prefix.pool)
    except Exception as exc:                             # noqa: BLE001 (its reason is the row's)
        return f"SGLang's MooncakeStore did not set up: {type(exc).__name__}: {exc}"
    probe = sglang_keys(uuid.uuid4().hex, "probe", 0, 1)
    try:
        done = backend.batch_set_v1(probe, prefix.source[:prefix.page_size], extra)
    except Exception as exc:                             # noqa: BLE001 (e.g. layer_first MHA, refused by SGLang)
        return f"SGLang's MooncakeStore refused a {prefix.pool.layout} page: {type(exc).__name__}: {exc}"
    if not all(done):
        return "SGLang's MooncakeStore could not store a probe page"

    def delete(keys: list[str]) -> None:             # SGLang's own key names (its clear() removes every object)
        names = backend._batch_preprocess(backend._tag_keys(keys), prefix.source[:len(keys) * prefix.page_size])[0]
        backend.store.batch_remove(names, True)

    delete(probe)
    return v1_runner("mooncake", "SGLang mooncake", "nothing", backend, prefix, batch, extra, delete,
                     backend.store.close)   # its own close() leaves the client to its destructor, after the master


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("sglang", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "redis", "torch"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


if __name__ == "__main__":
    sys.exit(main())
