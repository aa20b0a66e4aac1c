"""The Mooncake store on a real Mooncake Store (master, metadata server, segment holder on loopback): specs refused
at open, two processes sharing pages, a master killed and restarted mid-run, pages that vanish or change between
``exists`` and ``get``, zero-copy from the registered host pool, fork, threads, a full store."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.cache import build, close_all, prompt, serve
from helpers.mooncake import MooncakeServers, need_mooncake
from helpers.storage import GEOMETRY, PAGE, namespace, random_pages, read_pages

from kvtier.address import CpuAddress, DeviceAddress
from kvtier.cache import page_keys
from kvtier.errors import InvalidArgument
from kvtier.storage import MooncakeStore, StorageError, open_store
from kvtier.storage.format import HEADER_BYTES

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def mooncake_store(mooncake_spec):
    with open_store(mooncake_spec, namespace()) as s:
        yield s


@pytest.mark.parametrize("spec, words", [
    ("mooncake://", "the master needs host:port"),
    ("mooncake://127.0.0.1", "the master needs host:port"),
    ("mooncake://127.0.0.1:0", "port '0' is not 1-65535"),
    ("mooncake://127.0.0.1:99999", "port '99999' is not 1-65535"),
    ("mooncake://127.0.0.1:50051/db", "nothing may follow"),
    ("mooncake://user:pw@127.0.0.1:50051", "takes no user or password"),
    ("mooncake://127.0.0.1:50051?colour=red", "unknown option 'colour'"),
    ("mooncake://127.0.0.1:50051?protocol=udp", "protocol='udp'"),
    ("mooncake://127.0.0.1:50051?device=mlx5_0", "goes with protocol=rdma"),
    ("mooncake://127.0.0.1:50051?metadata=etcd-host:2379", "metadata='etcd-host:2379'"),
    ("mooncake://127.0.0.1:50051?metadata=http://host", "the metadata needs host:port"),
    ("mooncake://127.0.0.1:50051?admin=ftp://host:1", "admin='ftp://host:1'"),
    ("mooncake://127.0.0.1:50051?protocol=tcp&protocol=rdma", "protocol is given twice"),
    ("mooncake://127.0.0.1:50051?metadata=", "metadata= is empty"),
    ("mooncake://bad_host!:50051", "is not a host name"),
    ("mooncake://127.0.0.1:50051?local_hostname=a%20b", "local_hostname='a b' holds a space"),
])
def test_bad_specs_are_refused_at_open_naming_the_bad_part(spec, words):
    started = time.monotonic()
    with pytest.raises(InvalidArgument) as refused:
        open_store(spec, namespace())
    assert words in str(refused.value) and time.monotonic() - started < 1


@pytest.mark.parametrize("options, words", [
    ({"prefix": "a:b"}, "prefix='a:b'"), ({"segment_bytes": -1}, "segment_bytes must be >= 0, got -1"),
    ({"buffer_bytes": 1024}, "buffer_bytes must be >= 1048576, got 1024"), ({"connect_timeout": 0}, "connect_timeout"),
    ({"ttl": 5}, "unknown option 'ttl' for a mooncake store"),
])
def test_wrong_options_are_refused_by_name(options, words):
    with pytest.raises(InvalidArgument) as refused:
        open_store("mooncake://127.0.0.1:1", namespace(), **options)
    assert words in str(refused.value)


def test_a_master_that_is_not_there_is_a_fast_counted_miss():
    need_mooncake()
    keys = page_keys(namespace(), np.arange(3 * GEOMETRY.page_size))
    started = time.monotonic()
    with open_store("mooncake://127.0.0.1:1?metadata=P2PHANDSHAKE", namespace(), retry_interval=0,
                    connect_timeout=0.5) as store:
        assert store.set(keys, [[p] for p in random_pages(3)]) == 0
        assert store.exists(keys) == 0
        assert read_pages(store, keys)[0] == 0
        stats = store.stats()
    assert time.monotonic() - started < 5, "a client left to find the master on its own retries for 90 s"
    assert stats["errors.set"] == stats["errors.exists"] == stats["errors.get"] == 1 and not stats["up"]
    assert "unreachable" in store.last_error


def test_round_trips_from_registered_memory_copy_nothing(mooncake_store):
    store = mooncake_store
    arena = np.random.default_rng().integers(1, 256, 6 * PAGE, dtype=np.uint8)
    keys = page_keys(store.namespace, np.arange(6 * GEOMETRY.page_size))
    store.register_memory(CpuAddress(arena.ctypes.data), arena.nbytes)
    views = [[arena[i * PAGE:i * PAGE + PAGE // 3], arena[i * PAGE + PAGE // 3:(i + 1) * PAGE]] for i in range(6)]
    assert store.set(keys, views) == 6
    written = arena.copy()
    arena[:] = 0xA5
    assert store.get(keys, views) == 6 and np.array_equal(arena, written)
    assert "bounced_pages" not in store.stats()
    count, out = read_pages(store, keys)                   # a caller's own buffers: bounced, still exact
    assert count == 6 and np.array_equal(np.concatenate(out), written)
    assert store.stats()["bounced_pages"] == 6
    store.unregister_memory(CpuAddress(arena.ctypes.data))


def test_register_memory_takes_only_cpu_addresses_and_no_overlap(mooncake_store):
    store = mooncake_store
    arena = np.ones(2 * PAGE, np.uint8)
    for wrong in (arena.ctypes.data, DeviceAddress(arena.ctypes.data, 0)):
        with pytest.raises(InvalidArgument, match="CpuAddress"):
            store.register_memory(wrong, arena.nbytes)
    store.register_memory(CpuAddress(arena.ctypes.data), arena.nbytes)
    with pytest.raises(InvalidArgument, match="overlaps"):
        store.register_memory(CpuAddress(arena.ctypes.data + PAGE), PAGE)
    assert store.registered == [(CpuAddress(arena.ctypes.data), arena.nbytes)]
    store.unregister_memory(CpuAddress(arena.ctypes.data))
    assert store.registered == []


def test_a_page_removed_or_changed_between_exists_and_get_is_a_miss(mooncake_store, mooncake_spec):
    store = mooncake_store
    keys = page_keys(store.namespace, np.arange(6 * GEOMETRY.page_size))
    data = random_pages(6)
    assert store.set(keys, [[p] for p in data]) == 6 and store.exists(keys) == 6
    with open_store(mooncake_spec, store.namespace) as other:     # another server evicts one, rewrites one
        raw = other.client()
        assert other.delete([keys[4]]) == 1
        blob = bytearray(raw.get(other.key(keys[2])))
        blob[HEADER_BYTES + 5] ^= 0xFF
        raw.remove(other.key(keys[2]), True)
        assert raw.put(other.key(keys[2]), bytes(blob)) == 0
    count, out = read_pages(store, keys)
    assert count == 2 and all(np.array_equal(out[i], data[i]) for i in range(2))
    assert store.stats()["miss.corrupt"] == 1 and store.up
    assert store.exists(keys) == 2, "the damaged page was removed, so the next write replaces it"
    assert store.set(keys[2:], [[p] for p in data[2:]]) == 4
    count, out = read_pages(store, keys)
    assert count == 6 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))


def test_two_threads_share_one_store(mooncake_store):
    store = mooncake_store
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for round_ in range(8):
                keys = page_keys(store.namespace, np.arange(5 * GEOMETRY.page_size) + 10_000 * seed + 100 * round_)
                data = random_pages(5)
                assert store.set(keys, [[p] for p in data]) == 5
                count, out = read_pages(store, keys)
                assert count == 5 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def test_a_forked_child_gets_counted_misses_not_a_hang_or_a_crash(mooncake_store, mooncake_spec):
    store = mooncake_store
    keys = page_keys(store.namespace, np.arange(4 * GEOMETRY.page_size))
    data = random_pages(4)
    assert store.set(keys[:2], [[p] for p in data[:2]]) == 2
    pid = os.fork()
    if pid == 0:                   # Mooncake's client does not survive fork: old store and new one both refuse
        code = 1
        try:
            with open_store(mooncake_spec, store.namespace) as fresh:
                misses = read_pages(store, keys[:2])[0] == 0 and store.set(keys[2:], [[p] for p in data[2:]]) == 0
                misses = misses and fresh.exists(keys) == 0
                said = "forked" in store.last_error and "spawn" in fresh.last_error
            code = 0 if misses and said else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    count, out = read_pages(store, keys)
    assert count == 2 and all(np.array_equal(a, b) for a, b in zip(out, data[:2], strict=False))


def test_close_while_another_thread_reads_never_crashes(mooncake_spec):
    ns = namespace()
    store = open_store(mooncake_spec, ns)
    keys = page_keys(ns, np.arange(32 * GEOMETRY.page_size))
    data = random_pages(32)
    assert store.set(keys, [[p] for p in data]) == 32
    outcomes: list[object] = []

    def reader() -> None:
        while True:
            try:
                count, out = read_pages(store, keys)
            except StorageError as exc:
                outcomes.append(exc)
                return
            assert all(np.array_equal(out[i], data[i]) for i in range(count))
            outcomes.append(count)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.2)
    store.close()
    store.close()                                          # idempotent
    thread.join(10)
    assert not thread.is_alive() and isinstance(outcomes[-1], StorageError)


WRITER = """
import sys, numpy as np
from helpers.cache import build, close_all, serve
from kvtier.runtime import create
from kvtier.storage import open_store
spec, salt = sys.argv[1], bytes.fromhex(sys.argv[2])
prompts = [np.array(p) for p in __import__("json").loads(sys.argv[3])]
stores = []
def storage(ns):
    stores.append(open_store(spec, ns, layout=sys.argv[4]))
    return stores[0]
cache, model, dev, host = build(create("emulated:split"), device_pages=64, host_pages=128, storage=storage,
                                layout=sys.argv[4])
model.salt = salt
for p in prompts:
    serve(cache, model, p)
cache.drain()
written = cache.stats()["storage.set.pages"]
close_all(cache, dev, host)
stores[0].close()
print(int(written))
"""


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_page_written_by_one_process_is_served_byte_exact_by_another(mooncake_spec, runtime, layout):
    salt = np.random.default_rng().bytes(16)
    prompts = [prompt(4 * n) for n in (7, 12, 5)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", WRITER, mooncake_spec, salt.hex(),
                           json.dumps([p.tolist() for p in prompts]), layout],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= sum(len(p) // 4 for p in prompts)
    stores: list[MooncakeStore] = []

    def storage(ns):
        stores.append(open_store(mooncake_spec, ns, layout=layout))
        return stores[-1]

    cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage, layout=layout)
    model.salt = salt
    try:
        for p in prompts:
            fetch = cache.prefetch(p)
            assert fetch.settle("wait_complete") == len(p) and fetch.outcome == "complete"
            _, served = serve(cache, model, p)          # every served byte checked against the writer's KV
            assert served == len(p) // 4
        stats = stores[0].stats()
        assert stats["get.hit_pages"] == sum(len(p) // 4 for p in prompts) and "bounced_pages" not in stats
    finally:
        close_all(cache, dev, host)
    assert stores[0].registered == [], "the host pool was unregistered when the cache closed"
    stores[0].close()


def test_the_cache_serves_right_kv_while_its_master_is_killed_and_restarted(mooncake_servers, runtime):
    servers: MooncakeServers = mooncake_servers
    stores: list[MooncakeStore] = []

    def storage(ns):
        stores.append(open_store(servers.spec, ns, retry_interval=0.2, connect_timeout=0.3))
        return stores[-1]

    prompts = [prompt(4 * n) for n in (6, 9, 5)]
    cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage)
    salt = model.salt
    try:
        for p in prompts:
            serve(cache, model, p)
        cache.drain()
        servers.stop_master()
        started = time.monotonic()
        for p in [*prompts, prompt(24)]:
            cache.prefetch(p).settle("wait_complete")       # misses, counted; no exception
            serve(cache, model, p)                          # device and host tiers serve, bytes checked
        cache.drain()
        assert time.monotonic() - started < 30
        stats = cache.stats()
        assert sum(v for k, v in stats.items() if k.startswith("storage.errors.")) >= 1
    finally:
        close_all(cache, dev, host)
    servers.start_master()                                 # back, empty: the next cache writes and hits again
    servers.wait_segment()
    time.sleep(0.3)
    for round_ in ("write", "read"):
        cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage)
        model.salt = salt
        try:
            if round_ == "write":
                serve(cache, model, prompts[0])
                cache.drain()
                assert stores[-1].stats()["set.pages"] == len(prompts[0]) // 4
            else:
                fetch = cache.prefetch(prompts[0])
                assert fetch.settle("wait_complete") == len(prompts[0]) and fetch.outcome == "complete"
                serve(cache, model, prompts[0])
        finally:
            close_all(cache, dev, host)
    for store in stores:
        store.close()


def test_a_full_store_evicts_or_refuses_and_never_serves_wrong_bytes():
    servers = MooncakeServers(segment="16 MB")
    try:
        geometry_page = 256 * 1024
        from kvtier.pools import KVGeometry

        big = KVGeometry.mha(layers=4, kv_heads=8, head_dim=128, itemsize=2, page_size=16)
        assert big.bytes_per_page == geometry_page * 1
        ns = namespace(big)
        with open_store(servers.spec, ns, retry_interval=0) as store:
            keys = page_keys(ns, np.arange(160 * big.page_size))
            data = random_pages(160, big)
            stored = sum(store.set(keys[i:i + 16], [[p] for p in data[i:i + 16]]) for i in range(0, 160, 16))
            assert 0 < stored < 160 or store.stats().get("errors.set", 0) == 0
            readable = 0
            for i, key in enumerate(keys):
                count, out = read_pages(store, [key], big)
                if count:
                    assert np.array_equal(out[0], data[i])
                    readable += 1
            assert 0 < readable < 160, "16 MB cannot hold 40 MB of pages"
            if store.stats().get("errors.set"):
                assert "segment holder" in store.last_error or "no space" in store.last_error
    finally:
        servers.close()


def test_operators_need_the_admin_endpoint_to_list(mooncake_spec):
    without = mooncake_spec.split("&admin=")[0]
    with open_store(without, None) as store, pytest.raises(StorageError, match=r"\?admin=http://MASTER_HOST:9003"):
        list(store.entries())


def test_a_long_chain_is_looked_up_in_one_round_trip(mooncake_spec):
    with open_store(mooncake_spec, namespace(), batch_pages=8) as store:
        keys = page_keys(store.namespace, np.arange(100 * GEOMETRY.page_size))
        assert store.set(keys[:60], [[p] for p in random_pages(60)]) == 60

        def asked() -> int:
            metrics = store._admin("metrics").splitlines()
            wanted = "master_batch_exist_key_requests_total "
            return int(float(next(m.split()[1] for m in metrics if m.startswith(wanted))))

        before = asked()
        assert store.exists(keys) == 60
        assert asked() - before == 1, "100 keys with batch_pages=8 took more than one batch_is_exist"


def test_a_host_pool_closed_before_its_cache_leaves_nothing_registered(mooncake_spec, runtime):
    stores: list[MooncakeStore] = []

    def storage(ns):
        stores.append(open_store(mooncake_spec, ns))
        return stores[-1]

    cache, model, dev, host = build(runtime, device_pages=16, host_pages=32, storage=storage)
    address = host.buffer.cpu_address
    assert stores[0].registered == [(address, host.buffer.nbytes)]
    serve(cache, model, prompt(24))
    cache.drain()
    host.close()                                   # before the cache: its memory leaves the store's registry first
    assert stores[0].registered == []
    cache.close()
    dev.close()
    stores[0].close()


def test_a_read_in_parts_stops_at_a_miss_in_a_later_part_and_leaves_nothing_in_flight(mooncake_spec):
    from kvtier.pools import KVGeometry

    big = KVGeometry.mha(layers=4, kv_heads=8, head_dim=128, itemsize=2, page_size=16)     # 256 KiB pages
    ns = namespace(big)
    with open_store(mooncake_spec, ns, batch_pages=600) as store:      # one batch: three parts (64 MiB each)
        keys = page_keys(ns, np.arange(600 * big.page_size))
        data = random_pages(600, big)
        assert store.set(keys, [[p] for p in data]) == 600
        count, out = read_pages(store, keys, big)
        assert count == 600 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert store.delete([keys[400]]) == 1
        count, out = read_pages(store, keys, big)
        assert count == 400 and all(np.array_equal(out[i], data[i]) for i in range(400))
        assert store.stats()["miss.absent"] == 1
        ended: list[object] = []

        def reader() -> None:
            try:
                for _ in range(3):
                    count, out = read_pages(store, keys, big)
                    assert all(np.array_equal(out[i], data[i]) for i in range(count))
                ended.append("done")
            except StorageError as exc:
                ended.append(exc)

        reading = threading.Thread(target=reader)
        reading.start()
        time.sleep(0.05)
    reading.join(20)                                   # closed under it: the reader ends (StorageError), no crash
    assert not reading.is_alive() and len(ended) == 1


def test_a_metadata_server_that_is_not_there_is_named_and_costs_no_stall(mooncake_spec):
    master = mooncake_spec.split("?")[0]
    keys = page_keys(namespace(), np.arange(2 * GEOMETRY.page_size))
    started = time.monotonic()
    with open_store(f"{master}?metadata=http://127.0.0.1:1/metadata", namespace(), connect_timeout=0.5) as store:
        assert store.set(keys, [[p] for p in random_pages(2)]) == 0
        assert "metadata server does not answer: http://127.0.0.1:1/metadata" in store.last_error
    assert time.monotonic() - started < 5


def test_a_private_store_starts_on_other_ports_when_its_first_are_taken(monkeypatch):
    """A port found free can be bound by another process before the master binds it: the master exits, and the
    helper starts again on fresh ports instead of waiting out its timeout (and leaves nothing behind)."""
    import helpers.mooncake as mooncake_helpers
    from helpers.storage import free_port

    need_mooncake()
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_port()))     # bound, not listening: a connect is refused, a bind fails
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(mooncake_helpers, "free_port", lambda: next(ports, None) or free_port())
    made: list[str] = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(mkdtemp(**kw)) or made[-1])
    try:
        servers = MooncakeServers(segment="16 MB")
    finally:
        taken.close()
    try:
        assert len(made) == 2 and not os.path.exists(made[0])   # the first try's folder is gone
        assert servers.master is not None and servers.master.poll() is None
    finally:
        servers.close()
    assert not os.path.exists(made[1])
