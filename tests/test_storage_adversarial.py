"""Regressions from an adversarial review of the storage tier: each test failed before its fix."""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
from helpers.cache import build, close_all, serve
from helpers.storage import GEOMETRY, RedisClusterServers, namespace, random_pages, read_pages

from kvtier.cache import page_keys
from kvtier.cli import main
from kvtier.errors import InvalidArgument
from kvtier.runtime import create
from kvtier.storage import FileStore, MemoryStore, SharedPages, StorageError, open_store
from kvtier.storage import file as file_module

PAGE = GEOMETRY.bytes_per_page




def test_processes_sharing_a_bounded_directory_converge_on_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(file_module, "RESCAN_SECONDS", 0.0)
    ns = namespace()
    stored = FileStore(tmp_path, ns).stored_bytes
    bound = 20 * stored
    one, two = FileStore(tmp_path, ns, max_bytes=bound), FileStore(tmp_path, ns, max_bytes=bound)
    keys = page_keys(ns, np.arange(60 * GEOMETRY.page_size))
    pages = random_pages(60)
    for i in range(0, 60, 2):                      # the two "processes" take turns
        one.set(keys[i:i + 1], [[pages[i]]])
        two.set(keys[i + 1:i + 2], [[pages[i + 1]]])
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*/*/*.kvp"))
    assert on_disk <= bound, f"{on_disk / bound:.0%} of the bound"


def test_a_removed_namespace_directory_is_made_again(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, retry_interval=0)
    keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
    pages = random_pages(4)
    assert store.set(keys[:2], [[p] for p in pages[:2]]) == 2
    shutil.rmtree(store.directory)                  # an operator's rm -rf, a tmp cleaner
    first = store.set(keys[2:], [[p] for p in pages[2:]])       # may fail part-way: counted, directory re-made
    assert store.set(keys[2:], [[p] for p in pages[2:]]) == 2
    assert first == 2 or store.stats()["errors.set"] == 1
    assert read_pages(store, keys[2:])[0] == 2 and (store.directory / "namespace.json").exists()


def test_a_redis_key_of_the_wrong_type_is_one_miss_and_the_store_stays_up(redis_url):
    ns = namespace()
    with open_store(redis_url, ns) as store:
        keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
        store.set(keys, [[p] for p in random_pages(4)])
        store.client().delete(store.key(keys[2]))
        store.client().rpush(store.key(keys[2]), b"not a page")
        assert read_pages(store, keys)[0] == 2
        stats = store.stats()
        assert stats["miss.corrupt"] == 1 and stats.get("errors.get", 0) == 0 and stats["up"]
        assert read_pages(store, keys[:2])[0] == 2 and store.set(keys[2:3], [[random_pages(1)[0]]]) == 1
        assert read_pages(store, keys)[0] == 4, "the bad key was removed and rewritten"


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_read_only_buffer_to_read_into_is_refused_and_changes_nothing(kind, tmp_path):
    ns = namespace()
    store = MemoryStore(ns) if kind == "memory" else FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    store.set(keys, [[p] for p in random_pages(2)])
    frozen = np.zeros(PAGE, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        store.get(keys[:1], [[frozen]])
    with pytest.raises(InvalidArgument, match="read-only"):
        store.get(keys[:1], [[bytes(PAGE)]])
    assert store.up and "errors.get" not in store.stats() and read_pages(store, keys)[0] == 2
    with pytest.raises(InvalidArgument, match="not a buffer"):
        store.set(keys[:1], [[object()]])


def test_a_directory_or_fifo_at_a_page_path_is_a_miss_not_an_error_or_a_hang(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
    store.set(keys, [[p] for p in random_pages(3)])
    store.path(keys[1]).unlink()
    store.path(keys[1]).mkdir()
    assert read_pages(store, keys)[0] == 1
    assert store.stats()["miss.corrupt"] == 1 and store.up
    shutil.rmtree(store.path(keys[1]))
    os.mkfifo(store.path(keys[1]))
    done = []
    reader = threading.Thread(target=lambda: done.append(read_pages(store, keys)[0]), daemon=True)
    reader.start()
    reader.join(60)                                 # a hang is for good: the bound only has to end the test
    assert done == [1], "a FIFO at a page path hung the read"


@pytest.mark.parametrize("spec, options, words", [
    ("redis://127.0.0.1:abc/0", {}, "Port could not be cast"),
    ("redis://127.0.0.1:99999/0", {}, "out of range"),
    ("redis:///0", {}, "names no host"),
    ("redis://127.0.0.1:6379/0", {"timeout": -1}, "timeout=-1"),
    ("redis://127.0.0.1:6379/0", {"timeout": float("nan")}, "timeout=nan"),
    ("redis://127.0.0.1:6379/0", {"connect_timeout": "soon"}, "connect_timeout='soon'"),
    ("redis://127.0.0.1:6379/0", {"retry_interval": "1"}, "retry_interval='1'"),
    ("redis://127.0.0.1:6379/0", {"batch_pages": float("nan")}, "batch_pages=nan"),
    ("memory:foo", {}, "memory: takes nothing"),
    ("memory:", {"max_bytes": -5}, "max_bytes=-5"),
])
def test_bad_urls_and_options_are_refused_when_the_store_opens(spec, options, words):
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(")):
        open_store(spec, namespace(), **options)


def test_a_file_where_the_store_directory_should_be_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match=f"file store {blocker}: cannot make {blocker}/.*: Not a directory"):
        FileStore(blocker, namespace())


def test_a_frozen_cluster_node_costs_one_timeout_not_a_retry_loop():
    cluster = RedisClusterServers()
    frozen = cluster.servers[1].process
    try:
        ns = namespace()
        timeout = 1.0                               # long against a loaded machine's delays; a retry loop is 4+
        store = open_store(cluster.url, ns, retry_interval=0, timeout=timeout, connect_timeout=timeout)
        keys = page_keys(ns, np.arange(30 * GEOMETRY.page_size))
        assert store.set(keys, [[p] for p in random_pages(30)]) == 30
        frozen.send_signal(19)                      # SIGSTOP
        for call in (lambda: store.exists(keys), lambda: read_pages(store, keys), lambda: store.exists(keys)):
            start = time.monotonic()
            call()
            assert time.monotonic() - start < 4 * timeout
        assert store.stats()["errors.exists"] >= 1
        frozen.send_signal(18)                      # SIGCONT: the store finds the cluster again
        deadline = time.monotonic() + 20
        while store.exists(keys) != 30 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.exists(keys) == 30
        store.close()
    finally:
        frozen.send_signal(18)
        cluster.close()


def test_a_write_that_fails_part_way_counts_what_it_stored(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, retry_interval=0)
    keys = page_keys(ns, np.arange(6 * GEOMETRY.page_size))
    blocked = store.path(keys[3]).parent
    if any(store.path(k).parent == blocked for k in keys[:3]):
        pytest.skip("this draw put an earlier page in the blocked directory")
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("not a directory")
    assert store.set(keys, [[p] for p in random_pages(6)]) == 3
    assert store.exists(keys) == 3


def test_only_nodes_whose_pages_reached_storage_are_marked_stored():
    class FailSecondBatch(MemoryStore):
        calls = 0

        def _set(self, keys, pages):
            FailSecondBatch.calls += 1
            if FailSecondBatch.calls == 2:
                raise ConnectionError("store went away after the first batch")
            return super()._set(keys, pages)

    shared = SharedPages()
    cache, model, dev, host = build(create("emulated:split"), device_pages=4, host_pages=32,
                                    storage=lambda ns: FailSecondBatch(ns, shared=shared, batch_pages=2,
                                                                       retry_interval=0),
                                    write_policy="write_back")
    try:
        a, b, c, y = (np.full(4, v) for v in (1, 2, 3, 9))
        prompts = [np.concatenate([a, b]), np.concatenate([a, c]), y]
        for p in prompts:
            serve(cache, model, p)
        cache.evict(device_pages=4)                 # one backup of several branches, written in two batches
        cache.drain()
        for p in [a, *prompts]:
            node = cache.match_prefix(p).last_node
            keys = page_keys(cache.namespace, p)
            in_storage = cache.storage.exists(keys) == len(keys)
            assert node.stored == in_storage, (p, node.stored, in_storage)
    finally:
        close_all(cache, dev, host)


def test_an_unreachable_store_is_one_line_from_the_cli(capsys):
    assert main(["storage", "stats", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier storage: redis://127.0.0.1:1/0: ConnectionError") and "Traceback" not in err


def test_reads_stay_up_while_writes_fail(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, retry_interval=60)
    keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
    store.set(keys[:2], [[p] for p in random_pages(2)])
    blocked = store.path(keys[2]).parent
    if blocked.exists():
        pytest.skip("this draw shares a directory with the stored pages")
    blocked.write_text("full disk, say")
    assert store.set(keys[2:3], [[random_pages(1)[0]]]) == 0
    assert read_pages(store, keys[:2])[0] == 2, "a failing write path does not take reads down"
    assert not store.up



# -- second review ---------------------------------------------------------------------------------------------------

def test_a_full_redis_refusing_writes_still_serves_reads():
    from helpers.storage import RedisServer

    server = RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        ns = namespace()
        store = open_store(server.url, ns, retry_interval=0)
        keys = page_keys(ns, np.arange(4000 * GEOMETRY.page_size))
        assert store.set(keys[:4], [[p] for p in random_pages(4)]) == 4
        for start in range(4, 4000, 200):          # fill it until SET is refused (OOM)
            if store.set(keys[start:start + 200], [[p] for p in random_pages(200)]) < 200:
                break
        short: list[int] = []

        def reader():
            for _ in range(100):
                count = read_pages(store, keys[:4])[0]
                if count != 4:
                    short.append(count)

        readers = [threading.Thread(target=reader) for _ in range(3)]
        for thread in readers:
            thread.start()
        while any(thread.is_alive() for thread in readers):   # writes keep failing meanwhile
            store.set(keys[3990:3992], [[p] for p in random_pages(2)])
        for thread in readers:
            thread.join()
        assert store.stats()["errors.set"] >= 1
        assert not short, f"{len(short)} reads cut short while writes failed"
        store.close()
    finally:
        server.close()


def test_cluster_redirections_are_failures_and_wrongtype_is_a_miss():
    from redis.exceptions import AskError, ClusterDownError, MovedError, NoPermissionError, ResponseError, TryAgainError

    from kvtier.storage.redis_store import _wrong_value

    assert _wrong_value(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    for error in (MovedError("3999 127.0.0.1:6381"), AskError("3999 127.0.0.1:6381"), ClusterDownError("down"),
                  TryAgainError("again"), NoPermissionError("no"), ResponseError("ERR something")):
        assert not _wrong_value(error), error


def test_a_store_works_in_a_fork_child_after_its_threads_ran(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns, io_threads=4)
    keys = page_keys(ns, np.arange(8 * GEOMETRY.page_size))
    pages = random_pages(8)
    store.set(keys, [[p] for p in pages])
    assert read_pages(store, keys)[0] == 8             # the pool exists now
    pid = os.fork()
    if pid == 0:                                       # the child: its pool's threads do not exist
        import signal

        signal.alarm(20)
        count, out = read_pages(store, keys)
        os._exit(0 if count == 8 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=True)) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


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


def test_a_page_file_cut_inside_its_header_block_is_short(tmp_path):
    ns = namespace()
    store = FileStore(tmp_path, ns)
    keys = page_keys(ns, np.arange(GEOMETRY.page_size))
    store.set(keys, [[random_pages(1)[0]]])
    os.truncate(store.path(keys[0]), 1000)
    assert read_pages(store, keys)[0] == 0 and store.stats()["miss.short"] == 1
