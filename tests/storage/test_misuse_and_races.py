"""The storage tier misused and raced: malformed specs at open and through the CLI, prefetches into a host tier too
small for them, a host pool closed under storage I/O, closes from two threads with writes queued, failed writes, a
close during a read (no thread writes into the caller's buffers after it returns), an older success finishing after a
newer failure (the store stays down)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from helpers.cache import BOUND, P, build, close_all, joined, load_and_check, prompt, serve, spawn
from helpers.storage import (
    GEOMETRY,
    PAGE,
    Hooked,
    namespace,
    random_pages,
    read_pages,
    second,
    slow_cache,
    stores_of,
    warm,
)

from kvtier.cache import page_keys
from kvtier.cache.metrics import REASONS
from kvtier.cli import main
from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.storage import FileStore, MemoryStore, SharedPages, StorageError, open_store
from kvtier.storage.backend import PartialWrite


def documented(stats):
    """Every reason counter in ``stats`` has a documented label."""
    for key in stats:
        name, _, label = key.partition(".")
        if name in REASONS and label:
            assert label in REASONS[name], f"{key}: undocumented label"


# -- specs -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["redis://[::1/0", "redis://h]:6379/0", "rediss://[::1/0",
                                  "redis+cluster://[::1:7000", "unix://[/run/redis.sock"])
def test_an_unbalanced_ipv6_bracket_is_refused_as_invalid_argument(spec, tmp_path, monkeypatch):
    """A malformed Redis URL is InvalidArgument naming it, not a bare ValueError from urllib."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument, match="Redis URL"):
        open_store(spec, namespace())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("spec", ["redis://[::1]x:6379/0", "redis://[::1]junk/0", "rediss+cluster://[::1]:7000x"])
def test_text_between_an_ipv6_host_and_its_port_is_refused(spec):
    """urllib reads ``[::1]x:6379`` as host ::1 port 6379 and drops the ``x``; redis-py gets the URL as written.
    A malformed URL must be refused when the store opens."""
    with pytest.raises(InvalidArgument, match="Redis URL"):
        open_store(spec, namespace())


def test_demo_with_a_malformed_redis_url_prints_one_line_and_exits_2(capsys):
    code = main(["--runtime", "emulated:split", "demo", "--users", "1", "--turns", "1", "--storage",
                 "redis://[::1/0"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_storage_ls_with_a_malformed_redis_url_prints_one_line_and_exits_2(capsys):
    code = main(["storage", "ls", "redis://[::1/0"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("spec, words", [
    ("redis://h:1/0?db=0", "both"),
    ("redis://h:1/0/1", "database number"),
    ("redis://h:1/0?socket_timeout=0", "socket_timeout"),
    ("redis://h:1/0?socket_timeout=inf", "socket_timeout"),
    ("redis://h:1/0?socket_keepalive=maybe", "socket_keepalive"),
    ("redis://h:1/0?ssl_ca_certs=/etc/hostname", "TLS"),
    ("redis://h:1/0?client_name=a%20b", "client_name"),
    ("redis://h:1/0?decode_responses=true", "decode_responses"),
    ("redis://h:1/0?retry_on_timeout=true", "retry_on_timeout"),
    ("redis://h:1/0?password=a&password=b", "twice"),
    ("redis://u:p@h:1/0?username=v", "once"),
    ("redis://h:1/0#x", "fragment"),
    ("redis://h:99999/0", "Port"),
    ("redis://:6379/0", "no host"),
    ("redis+cluster://h:7000/0", "cluster"),
    ("redis+cluster://h:7000?db=1", "db 0"),
    ("unix://h/run/redis.sock", "no host"),
    ("unix:///", "path"),
    ("unix:///run/redis.sock?db=x", "db"),
    ("rediss://h:1/0?ssl_cert_reqs=none&ssl_check_hostname=true", "ssl_check_hostname"),
    ("rediss://h:1/0?ssl_min_version=TLSv1_1", "ssl_min_version"),
    ("rediss://h:1/0?ssl_keyfile=/etc/hostname", "ssl_keyfile"),
    ("rediss://h:1/0?ssl_ca_certs=/nonexistent.pem", "ssl_ca_certs"),
    ("rediss://h:1/0?ssl_ciphers=NOT-A-CIPHER", "ssl_ciphers"),
])
def test_malformed_redis_urls_are_refused_naming_the_bad_part(spec, words):
    with pytest.raises(InvalidArgument, match=words):
        open_store(spec, namespace())


@pytest.mark.parametrize("spec, options, words", [
    ("file:{tmp}/s", {"max_bytes": "1G"}, "max_bytes"),
    ("file:{tmp}/s", {"fsync": True}, "fsync"),
    ("file:{tmp}/s", {"overwrite": 1}, "overwrite"),
    ("file:{tmp}/s", {"retry_interval": float("nan")}, "retry_interval"),
    ("file:{tmp}/s", {"batch_pages": 0}, "batch_pages"),
    ("file:{tmp}/s", {"io_threads": True}, "io_threads"),
    ("file:{tmp}/s", {"layout": "diagonal"}, "diagonal"),
    ("file:{tmp}/s", {"ttl": 5}, "ttl"),
    ("file:{tmp}/s", {"max_byte": 1 << 30}, "max_byte"),
    ("redis://127.0.0.1:1/0", {"ttl": 1.5}, "ttl"),
    ("redis://127.0.0.1:1/0", {"timeout": "1"}, "timeout"),
    ("redis://127.0.0.1:1/0?socket_timeout=1", {"timeout": 2}, "once"),
    ("redis://127.0.0.1:1/0", {"prefix": "a:b"}, "prefix"),
    ("redis://127.0.0.1:1/0", {"cluster": "yes"}, "cluster"),
    ("redis://127.0.0.1:1/0", {"socket_timeout": 1}, "socket_timeout"),
    ("memory:", {"max_bytes": 0}, "max_bytes"),
    ("file:{tmp}/s", {"retry_interval": 10**400}, "retry_interval"),
    ("redis://127.0.0.1:1/0", {"timeout": 10**400}, "timeout"),
    ("redis://127.0.0.1:1/0", {"connect_timeout": 10**400}, "connect_timeout"),
    ("memory:", {"shared": "pages"}, "shared"),
])
def test_wrong_options_are_refused_by_name_and_nothing_is_made(spec, options, words, tmp_path):
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(InvalidArgument, match=words):
        open_store(spec, namespace(), **options)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("spec", ["bogus:x", "/abs/store", "store", "./store", "File:/x", "files:/x", "redis:/h:1",
                                  "file:?x", "file://host/x", "memory:x"])
def test_unknown_schemes_and_bare_paths_make_nothing(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgument):
        open_store(spec, namespace())
    assert os.listdir(tmp_path) == []


def test_a_failed_file_open_leaves_no_record_temporary(tmp_path, monkeypatch):
    """The record write fails (disk full) on open: StorageError naming namespace.json, no ``.namespace.*.tmp``."""
    import kvtier.storage.file as file_module

    def full(path, data):
        with open(path, "wb") as f:
            f.write(data[:3])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(file_module, "write_file", full)
    with pytest.raises(StorageError, match="namespace.json"):
        open_store(f"file:{tmp_path}", namespace())
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_stale_temporaries_of_a_dead_writer_are_swept_and_a_live_ones_kept(tmp_path):
    ns = namespace()
    with open_store(f"file:{tmp_path}", ns) as store:
        directory = tmp_path / store.namespace_id
        key = page_keys(ns, np.arange(P))[0].hex()
        (directory / key[:2]).mkdir(exist_ok=True)
    dead = 2**22 + 12345                       # past pid_max on this machine: surely not running
    assert not os.path.exists(f"/proc/{dead}")
    stale = [directory / f".namespace.{dead}.7.tmp", directory / key[:2] / f".{key}.{dead}.7.tmp"]
    live = [directory / ".namespace.1.7.tmp", directory / key[:2] / f".{key}.1.7.tmp"]   # pid 1 runs
    for path in stale + live:
        path.write_bytes(b"torn")
        os.utime(path, (2**31, 2**31))         # written after pid 1 started: pid 1's own
    with open_store(f"file:{tmp_path}", ns):
        pass
    assert [p.exists() for p in stale] == [False, False]
    assert [p.exists() for p in live] == [True, True]


# -- prefetch into a host tier too small for it --------------------------------------------------------------------
def test_a_prefetch_whose_last_batch_only_partly_fits_commits_exactly_what_fits(rt):
    storage, stores = stores_of()
    tokens = prompt(40 * P)
    salt = warm(rt, storage, [tokens])
    cache, model, dev, host = second(rt, storage, salt, host_pages=20, storage_write=False, storage_batch_pages=8)
    try:
        fetch = cache.prefetch(tokens)
        fetch.settle("wait_complete")
        assert (fetch.outcome, fetch.stored_pages, fetch.committed_pages) == ("host_full", 40, 20)
        stats = cache.stats()
        assert stats["prefetch_skipped.host_full"] == 20
        assert stats["hit_tokens.storage"] == 20 * P
        assert stats["storage_pages.read"] == 20
        documented(stats)
        match, served = serve(cache, model, tokens)
        assert (match.host_tokens, served) == (20 * P, 20)
        cache.check()
    finally:
        close_all(cache, dev, host)
        for store in stores:
            store.close()


def test_a_prefetch_past_a_host_prefix_commits_what_fits_behind_it(rt):
    """The prompt's first 8 pages are already on the host (locked by a request); 32 more are stored; 12 free host
    pages: the 12 pages right after the host prefix are committed and correct."""
    storage, stores = stores_of()
    tokens = prompt(40 * P)
    salt = warm(rt, storage, [tokens])
    cache, model, dev, host = second(rt, storage, salt, host_pages=20, storage_write=False)
    try:
        serve(cache, model, tokens[:8 * P])
        cache.drain()
        cache.evict(device_pages=64)
        held = cache.match_prefix(tokens, lock=True)
        assert held.host_tokens == 8 * P
        fetch = cache.prefetch(tokens)
        fetch.settle("wait_complete")
        assert (fetch.outcome, fetch.start_page, fetch.stored_pages, fetch.committed_pages) == \
            ("host_full", 8, 32, 12)
        assert cache.stats()["prefetch_skipped.host_full"] == 20
        cache.unlock(held)
        match, served = serve(cache, model, tokens)
        assert (match.host_tokens, served) == (20 * P, 20)
        cache.check()
    finally:
        close_all(cache, dev, host)
        for store in stores:
            store.close()


# -- a host pool closed under storage I/O --------------------------------------------------------------------------
def test_a_host_pool_closed_while_a_write_through_is_in_flight_stores_the_right_bytes(rt):
    started = threading.Event()

    class Slow(Hooked):
        def _set(self, keys, pages):
            started.set()
            return super()._set(keys, pages)

    storage, stores = stores_of(Slow)

    cache, model, dev, host = build(rt, device_pages=32, host_pages=64, storage=storage)
    stores[0].delay = 0.3
    tokens = prompt(8 * P)
    try:
        serve(cache, model, tokens)
        assert started.wait(BOUND)
        host.close()                                  # waits for the write reading its pages
        assert stores[0].exists(page_keys(cache.namespace, tokens)) == 8
        with pytest.raises(BufferClosed, match="host pool"):
            cache.match_prefix(tokens)
        cache.close()
        dev.close()
        # a second cache reads them back: every byte is the first one's
        salt = model.salt
        stores[0].delay = 0
        again, model2, dev2, host2 = second(rt, storage, salt, storage_write=False)
        try:
            fetch = again.prefetch(tokens)
            fetch.settle("wait_complete")
            assert fetch.committed_pages == 8
            load_and_check(again, model2, tokens)
        finally:
            close_all(again, dev2, host2)
    finally:
        cache.close()
        host.close()
        dev.close()
        for store in stores:
            store.close()


def test_a_host_pool_closed_while_a_prefetch_reads_into_it(rt):
    reading = threading.Event()

    class Slow(Hooked):
        def _get(self, keys, pages):
            reading.set()
            yield from super()._get(keys, pages)

    storage, stores = stores_of(Slow)

    tokens = prompt(16 * P)
    salt = warm(rt, storage, [tokens])
    cache, model, dev, host = second(rt, storage, salt, storage_write=False, storage_batch_pages=4)
    stores[-1].delay = 0.2
    try:
        fetch = cache.prefetch(tokens)
        assert reading.wait(BOUND)
        closer, closed = spawn("closer", host.close)
        joined(closer)
        assert closed == [("ok", None)]
        assert fetch.wait(BOUND)
        assert fetch.outcome in REASONS["prefetches"]
        assert fetch.settle() == fetch.committed_tokens
        with pytest.raises(BufferClosed, match="host pool"):
            cache.match_prefix(tokens)
        with pytest.raises(BufferClosed, match="host pool"):
            cache.prefetch(tokens)
        documented(cache.stats())
        cache.close()
    finally:
        cache.close()
        host.close()
        dev.close()
        for store in stores:
            store.close()


# -- close with queued writes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cancels", [(False, False), (True, True), (False, True), (True, False)])
def test_close_from_two_threads_at_once_accounts_for_every_page(rt, cancels):
    shared = SharedPages()
    cache, model, dev, host, store = slow_cache(rt, shared)
    prompts = [prompt(4 * P) for _ in range(8)]
    for tokens in prompts:
        serve(cache, model, tokens)
    barrier = threading.Barrier(2)

    def closing(cancel):
        barrier.wait(BOUND)
        cache.close(cancel=cancel)

    threads = [spawn(f"closer-{i}", lambda c=c: closing(c)) for i, c in enumerate(cancels)]
    try:
        for thread, result in threads:
            joined(thread)
            assert result == [("ok", None)], result
        stats = cache.stats()
        documented(stats)
        written = sum(store.exists(page_keys(cache.namespace, t)) for t in prompts)
        assert stats["storage_pages.written"] == written
        skipped = {k: v for k, v in stats.items() if k.startswith(("storage_skipped.", "skipped.")) and v}
        assert set(skipped) <= {"storage_skipped.cancelled_at_close", "skipped.cancelled_at_close"}
        accounted = written + skipped.get("storage_skipped.cancelled_at_close", 0) + \
            4 * skipped.get("skipped.cancelled_at_close", 0)
        assert accounted == 4 * len(prompts)
        if cancels == (False, False):
            assert written == 4 * len(prompts)
        assert cache.device.free_pages == cache.device.pages and cache.host.free_pages == cache.host.pages
    finally:
        host.close()
        dev.close()
        store.close()


def test_close_without_cancel_while_another_thread_serves(rt):
    """Requests keep coming on another thread while close(cancel=False) runs: every page a request got into the
    cache before close refused it is stored; the serving thread sees BufferClosed, nothing else. The pools hold every
    prompt the server may serve (at most ``limit``): with 64 device pages a fast server outran the backups under load
    and write_through evicted prompts not yet backed up (``skipped.evicted_without_backup``, never stored)."""
    shared = SharedPages()
    limit = 200
    cache, model, dev, host, store = slow_cache(rt, shared, delay=0.005, device_pages=2 * limit + 8,
                                                host_pages=2 * limit + 8)
    served: list = []
    tried: list = []                                # a request may get in and then meet the close at its unlock
    stop = threading.Event()

    def serving():
        while not stop.is_set() and len(tried) < limit:
            tokens = prompt(2 * P)
            tried.append(tokens)
            serve(cache, model, tokens)
            served.append(tokens)

    server, outcome = spawn("server", serving)
    try:
        while len(served) < 5:
            assert server.is_alive(), outcome
            threading.Event().wait(0.01)
        cache.close(cancel=False)
        stop.set()
        joined(server)
        assert outcome and outcome[0][0] == "raised" and isinstance(outcome[0][1], BufferClosed), outcome
        stats = cache.stats()
        written = stats["storage_pages.written"]
        assert stats["skipped.evicted_without_backup"] == 0, "the pools were too small for the prompts served"
        assert written == sum(store.exists(page_keys(cache.namespace, t)) for t in tried)
        assert [store.exists(page_keys(cache.namespace, t)) for t in served] == [2] * len(served)
        assert not {k for k, v in stats.items() if k.startswith(("storage_skipped.", "skipped.")) and v}
    finally:
        stop.set()
        joined(server)
        cache.close()
        host.close()
        dev.close()
        store.close()


# -- a failed write counted once ----------------------------------------------------------------------------------
class HalfStored(MemoryStore):
    """Stores the first half of every batch, then fails."""

    def _set(self, keys, pages):
        half = len(keys) // 2
        if half:
            super()._set(keys[:half], pages[:half])
        raise PartialWrite(half, ConnectionError("connection reset"))


def test_a_partial_write_counts_only_the_pages_not_stored_once(rt):
    made = []

    def storage(ns):
        made.append(HalfStored(ns, shared=SharedPages(), batch_pages=4, retry_interval=0))
        return made[-1]

    cache, model, dev, host = build(rt, device_pages=64, host_pages=128, storage=storage)
    try:
        tokens = prompt(12 * P)
        serve(cache, model, tokens)
        cache.drain()
        stats = cache.stats()
        documented(stats)
        stored = made[0].exists(page_keys(cache.namespace, tokens))
        assert stored == 2
        assert stats["storage_pages.written"] == 2
        assert {k: v for k, v in stats.items() if k.startswith("storage_skipped.") and v} == \
            {"storage_skipped.store_failed": 10}
    finally:
        cache.close()
        host.close()
        dev.close()
        made[0].close()


def test_a_store_closed_under_the_writer_counts_each_page_once(rt):
    """The caller closes the store while writes are queued: each page is stored or counted once as store_failed."""
    shared = SharedPages()
    cache, model, dev, host, store = slow_cache(rt, shared, delay=0.02)
    prompts = [prompt(4 * P) for _ in range(6)]
    try:
        for tokens in prompts:
            serve(cache, model, tokens)
        store.close()
        cache.drain()
        stats = cache.stats()
        documented(stats)
        written = stats["storage_pages.written"]
        failed = stats["storage_skipped.store_failed"]
        assert written + failed == 4 * len(prompts), stats
        skipped = {k for k, v in stats.items() if k.startswith("storage_skipped.") and v}
        assert skipped <= {"storage_skipped.store_failed"}
    finally:
        cache.close()
        host.close()
        dev.close()


def test_close_during_a_get_never_leaves_a_thread_writing_into_the_callers_buffers(tmp_path):
    class Slow(FileStore):
        def _read_page(self, key, pieces):
            time.sleep(0.2)
            return super()._read_page(key, pieces)

    class ClosingPool:
        """Submits two pages, then the store is closed (another thread) before the third is submitted."""

        def __init__(self, pool):
            self.pool, self.calls = pool, 0

        def submit(self, *args):
            self.calls += 1
            if self.calls == 3:
                store._closed = True
                raise RuntimeError("cannot schedule new futures after shutdown")
            return self.pool.submit(*args)

        def shutdown(self, wait=True):
            self.pool.shutdown(wait=wait)

    ns = namespace()
    store = Slow(tmp_path, ns, io_threads=2)
    keys = page_keys(ns, np.arange(8 * GEOMETRY.page_size))
    store.set(keys, [[p] for p in random_pages(8)])
    store._pool = ClosingPool(store._pool)
    out = [np.zeros(PAGE, np.uint8) for _ in keys]
    try:
        store.get(keys, [[o] for o in out])
    except Exception as exc:  # noqa: BLE001 - a StorageError naming the close is fine
        assert "closed" in str(exc)
    left = [o.copy() for o in out]
    time.sleep(0.5)
    assert all(np.array_equal(a, b) for a, b in zip(left, out, strict=True)), "written after get returned"
    assert "errors.get" not in store.stats(), "a close is not a store failure"
    store._pool.shutdown()


def test_an_older_success_does_not_undo_a_newer_failure():
    class Flaky(MemoryStore):
        def _get(self, keys, pages):
            if threading.current_thread().name == "slow":
                time.sleep(0.3)
                yield from super()._get(keys, pages)
            else:
                raise ConnectionError("down")

    ns = namespace()
    store = Flaky(ns, retry_interval=30)
    keys = page_keys(ns, np.arange(GEOMETRY.page_size))
    store.set(keys, [[random_pages(1)[0]]])
    slow = threading.Thread(target=lambda: read_pages(store, keys), name="slow")
    slow.start()
    time.sleep(0.1)
    assert read_pages(store, keys)[0] == 0             # fails while the slow call is in flight
    slow.join()
    assert not store.up and "reconnects" not in store.stats()
    assert read_pages(store, keys)[0] == 0 and store.stats()["miss.down"] == 1   # still backing off
