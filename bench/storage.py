"""Storage benchmark: ``set`` / ``get`` of whole pages through kvtier's backends, beside the same bytes through the
plain tool in the same run, and the latency of a prefetch of a long chain through the cache.

Pages (bf16): Llama-3-8B with 16 and 64 tokens (32 layers, K and V: 2 MiB and 8 MiB) and DeepSeek-V3 MLA with 64
tokens (61 layers of 1152-byte latents: 4.3 MiB), read from and written to a ``page_first`` host pool (two pieces
per MHA page, one per MLA page). About ``--mib`` MiB of pages per row.

Ceilings, same bytes, same run:
- file: one plain file per page, written with ``write`` per piece and read with ``readinto`` (no header, checksum,
  temporary file or rename); warm rows read from the page cache, cold rows after ``fsync`` + ``POSIX_FADV_DONTNEED``
  on every file (the kernel drops the cached pages) for both kvtier and the ceiling.
- redis: redis-py's own pipelined ``SET`` of a prepared ``bytes`` value and ``GET`` (batches of 32, like kvtier).
- mooncake: Mooncake's own ``batch_put_from`` / ``batch_get_into`` of the same bytes from and into registered
  memory, one contiguous buffer per page, no header or checksum (batches of 32, like kvtier); checked after timing.

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
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
from kvtier.storage import HostPages, open_store  # noqa: E402
from kvtier.storage.format import HEADER_BYTES  # noqa: E402

SIZES = {
    "llama3-8b-p16": KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=16),
    "llama3-8b-p64": KVGeometry.mha(layers=32, kv_heads=8, head_dim=128, itemsize=2, page_size=64),
    "deepseek-v3-p64": KVGeometry.mla(layers=61, latent_bytes=1152, page_size=64),
}
BATCH = 32


def paired(mine, plain, repeats: int, before_mine=None, before_plain=None, settle=False) -> tuple[float, float]:
    """Median seconds of ``mine`` and of ``plain``, run in turns (so drift in the machine — writeback, another
    tenant — hits both alike). ``settle``: ``os.sync()`` before each timed call (no writeback under a read)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, before, out in ((mine, before_mine, times[0]), (plain, before_plain, times[1])):
            if before:
                before()
            if settle:
                os.sync()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def drop_cache(paths: list[Path]) -> None:
    """Write back and drop the page cache of these files (clean pages go at POSIX_FADV_DONTNEED)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_rows(store_kind: str, spec: str, name: str, geometry: KVGeometry, runtime, mib: int, repeats: int,
              directory: Path | None) -> list[dict]:
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
    rows: list[dict] = []
    try:
        with pages.batch(np.arange(count)) as source, pages.batch(np.arange(count, 2 * count)) as target:
            pieces = [source.pieces(i) for i in range(count)]
            into = [target.pieces(i) for i in range(count)]

            def kv_set() -> None:
                assert store.set(keys, pieces) == count

            def kv_get() -> None:
                assert store.get(keys, into) == count

            kv_set()
            if store_kind == "file":
                assert directory is not None
                plain_dir = directory / f"plain-{time.time_ns()}"
                plain_dir.mkdir(parents=True)
                plain = [plain_dir / f"{i}.bin" for i in range(count)]

                def plain_set() -> None:
                    for path, page in zip(plain, pieces, strict=False):
                        with open(path, "wb") as file:
                            for piece in page:
                                file.write(piece)

                def plain_get() -> None:
                    for path, page in zip(plain, into, strict=False):
                        with open(path, "rb", buffering=0) as file:
                            for piece in page:
                                file.readinto(piece)

                set_s, ceiling_set = paired(kv_set, plain_set, repeats, lambda: store.delete(keys),  # new pages
                                            lambda: [p.unlink(missing_ok=True) for p in plain], settle=True)
                rows.append(row(store_kind, name, "set", "", nbytes, set_s, ceiling_set))
                mine = [store.path(k) for k in keys]  # type: ignore[attr-defined]
                for state, before_kv, before_plain in (("warm", None, None),
                                                       ("cold", lambda: drop_cache(mine), lambda: drop_cache(plain))):
                    get_s, ceiling_get = paired(kv_get, plain_get, repeats, before_kv, before_plain, settle=True)
                    rows.append(row(store_kind, name, "get", state, nbytes, get_s, ceiling_get))
                shutil.rmtree(plain_dir, ignore_errors=True)
            elif store_kind == "mooncake":
                rows += mooncake_rows(store, keys, name, pieces, into, kv_set, kv_get, nbytes, repeats)
            else:
                import redis

                client = redis.Redis.from_url(spec)
                values = [b"".join(bytes(p) for p in page) for page in pieces]
                raw_keys = [f"bench-raw:{namespace.digest.hex()[:16]}:{k.hex()}" for k in keys]

                def raw_set() -> None:
                    for start in range(0, count, BATCH):
                        pipe = client.pipeline(transaction=False)
                        for key, value in zip(raw_keys[start:start + BATCH], values[start:start + BATCH], strict=False):
                            pipe.set(key, value)
                        pipe.execute()

                def raw_get() -> None:
                    for start in range(0, count, BATCH):
                        pipe = client.pipeline(transaction=False)
                        for key in raw_keys[start:start + BATCH]:
                            pipe.get(key)
                        pipe.execute()

                raw_set()
                rows.append(row(store_kind, name, "set", "", nbytes,
                                *paired(kv_set, raw_set, repeats, lambda: store.delete(keys),
                                        lambda: client.delete(*raw_keys))))
                rows.append(row(store_kind, name, "get", "", nbytes, *paired(kv_get, raw_get, repeats)))
                client.delete(*raw_keys)
                client.close()
            assert store.stats().get("errors.get", 0) == 0 and store.stats().get("errors.set", 0) == 0
            assert store.stats().get("bounced_pages", 0) == 0, "pages of a registered pool went through a copy"
            assert all(np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
                       for x, y in zip(pieces, into, strict=True) for a, b in zip(x, y, strict=True)), \
                "pages read back differ"
        store.clear()
    finally:
        store.close()
        pages.close()
        pool.close()
    return rows


def mooncake_rows(store, keys, name: str, pieces, into, kv_set, kv_get, nbytes: int, repeats: int) -> list[dict]:
    """kvtier's Mooncake store against Mooncake's own batch calls of the same bytes, on the same client, from and
    into one registered contiguous buffer (a page per key, no header, no checksum); and, as a third row, Mooncake's
    own multi-buffer get of kvtier's stored pages into the pool's pieces, unchecked (what the API costs by itself)."""
    client = store.client()
    count = len(pieces)
    page = nbytes // count
    source = np.concatenate([np.frombuffer(piece, np.uint8) for pieces_of in pieces for piece in pieces_of])
    target = np.full(nbytes, 0xA5, np.uint8)
    for buffer in (source, target):
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

    headers = np.empty(BATCH * HEADER_BYTES, np.uint8)
    assert client.register_buffer(headers.ctypes.data, headers.nbytes) == 0
    try:
        rows = [row("mooncake", name, "set", "", nbytes,
                    *paired(kv_set, raw_set, repeats, lambda: store.delete(keys), raw_delete))]
        rows.append(row("mooncake", name, "get", "", nbytes, *paired(kv_get, raw_get, repeats)))
        assert np.array_equal(source, target), "Mooncake's own get returned other bytes than were put"
        rows.append(row("mooncake", name, "get", "multi-buffer, no check", nbytes,
                        *paired(raw_get_pieces, raw_get, repeats)))
    finally:
        raw_delete()
        for buffer in (source, target, headers):
            client.unregister_buffer(buffer.ctypes.data)
    return rows


def piece_address(piece) -> int:
    return int(np.frombuffer(piece, np.uint8).__array_interface__["data"][0])


def page_digest(pieces) -> bytes:
    digest = xxhash.xxh3_128()
    for piece in pieces:
        digest.update(piece)
    return digest.digest()


def check_pages(pool: HostPool, ids: np.ndarray, expected: list[bytes]) -> None:
    """Every page of the chain, in order, is in ``pool`` at ``ids`` with the bytes that were written."""
    assert len(ids) == len(expected), f"{len(ids)} pages in the host tier, {len(expected)} written"
    pages = HostPages(pool)
    try:
        with pages.batch(ids) as io:
            wrong = [i for i in range(len(ids)) if page_digest(io.pieces(i)) != expected[i]]
    finally:
        pages.close()
    assert not wrong, f"{len(wrong)} prefetched pages differ from what was written (first: page {wrong[0]})"


def row(store: str, size: str, op: str, state: str, nbytes: int, seconds: float, ceiling: float) -> dict:
    gbps, ceiling_gbps = nbytes / seconds / 1e9, nbytes / ceiling / 1e9
    return {"store": store, "page": size, "op": op, "cache": state, "bytes": nbytes, "gbps": gbps,
            "ceiling_gbps": ceiling_gbps, "pct": 100 * gbps / ceiling_gbps}


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
        with source.batch(np.arange(pages)) as io:
            store.set(page_keys(namespace, prompt), [io.pieces(i) for i in range(pages)])
            expected = [page_digest(io.pieces(i)) for i in range(pages)]
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
                             "bytes": nbytes})
            finally:
                cache.close()
                host.close()
                device.close()
        store.clear()
    finally:
        store.close()
    return rows


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
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    runtime = get_runtime(args.runtime)
    console = Console()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-bench-store-"))
    started = None
    mooncake_dir: Path | None = None
    specs = {}
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
    rows, prefetches = [], []
    try:
        for kind, spec in specs.items():
            for name in args.sizes:
                rows += page_rows(kind, spec, name, SIZES[name], runtime, args.mib, args.repeats, directory)
                console.print(f"{kind} {name}: done")
            if args.prefetch_tokens:
                for layout in args.host_layouts:
                    prefetches += prefetch_rows(kind, spec, runtime, args.prefetch_tokens, directory, layout)
    finally:
        if started is not None:
            stop_redis(started)
        if mooncake_dir is not None:
            stop_mooncake(mooncake_dir)
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    table = Table(title=f"kvtier storage — pages through kvtier vs the plain tool, same bytes, same run "
                        f"({os.cpu_count()} CPUs, runtime {runtime.name})")
    for column in ("store", "page", "op", "page cache", "kvtier GB/s", "plain GB/s", "% of plain"):
        table.add_column(column, justify="right" if "GB/s" in column or "%" in column else "left")
    for r in rows:
        table.add_row(r["store"], r["page"], r["op"], r["cache"], f"{r['gbps']:.2f}", f"{r['ceiling_gbps']:.2f}",
                      f"{r['pct']:.0f}%")
    console.print(table)
    if prefetches:
        table = Table(title="prefetch of a chain into an empty host tier (Llama-3-8B, 16-token pages)")
        for column in ("store", "tokens", "host layout", "page cache", "host pool", "seconds", "GB/s"):
            table.add_column(column)
        for r in prefetches:
            table.add_row(r["store"], f"{r['tokens']:,}", r["layout"], r["cache"], r["host_pool"],
                          f"{r['seconds']:.3f}", f"{r['gbps']:.2f}")
        console.print(table)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"cpus": os.cpu_count(), "runtime": runtime.name, "rows": rows, "prefetch": prefetches}, file,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
