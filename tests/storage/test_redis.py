"""Redis-specific promises on real servers: a server stopped mid-run is misses and counts, never an exception,
and hits again once it is back; a cluster spreads pages over its nodes; ACL users and passwords in the URL. A key of
the wrong type is one miss, a frozen cluster node costs one timeout, a full server refusing writes still serves
reads, and cluster redirections are failures, not misses."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import redis
from helpers.storage import CLI, GEOMETRY, RedisClusterServers, RedisServer, namespace, random_pages, read_pages

from kvtier.cache import page_keys
from kvtier.cli import main
from kvtier.storage import RedisStore, open_store


def test_a_server_stopped_mid_run_is_misses_then_hits_again(own_server):
    ns = namespace()
    store = RedisStore(own_server.url, ns, retry_interval=0.2, timeout=1.0, connect_timeout=0.5)
    keys = page_keys(ns, np.arange(6 * GEOMETRY.page_size))
    pages = random_pages(6)
    assert store.set(keys[:3], [[p] for p in pages[:3]]) == 3
    own_server.stop()
    assert read_pages(store, keys[:3])[0] == 0
    assert store.exists(keys) == 0
    assert store.set(keys[3:], [[p] for p in pages[3:]]) == 0
    stats = store.stats()
    assert not stats["up"] and stats["errors.get"] >= 1
    assert stats["exists.skipped_down"] == 1, "reads stay down for retry_interval: no second wait on a dead server"
    assert stats["errors.set"] == 1
    own_server.start()                                   # back, empty (nothing was saved)
    time.sleep(0.25)
    assert store.set(keys, [[p] for p in pages]) == 6
    count, out = read_pages(store, keys)
    assert count == 6 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=False))
    stats = store.stats()
    assert stats["up"] and stats["reconnects"] >= 1
    store.close()


def test_a_server_down_at_start_is_a_miss_not_an_exception(own_server):
    url = own_server.url
    own_server.stop()
    ns = namespace()
    store = RedisStore(url, ns, retry_interval=0.1, connect_timeout=0.2)
    keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
    assert store.exists(keys) == 0 and read_pages(store, keys)[0] == 0
    assert store.set(keys, [[p] for p in random_pages(2)]) == 0
    store.close()


def test_a_cluster_spreads_pages_over_its_nodes(redis_cluster_url):
    ns = namespace()
    with open_store(redis_cluster_url, ns) as store:
        keys = page_keys(ns, np.arange(60 * GEOMETRY.page_size))
        pages = random_pages(60)
        assert store.set(keys, [[p] for p in pages]) == 60
        nodes = {store.client().get_node_from_key(store.key(k)).name for k in keys}
        assert len(nodes) == 3
        count, out = read_pages(store, keys)
        assert count == 60 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=False))
        assert store.clear() == 60


def test_acl_user_and_password_in_the_url():
    server = RedisServer("--user", "default", "off", "--user", "kv", "on", ">s3cret", "~*", "+@all")
    try:
        ns = namespace()
        keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
        with open_store(f"redis://kv:s3cret@127.0.0.1:{server.port}/0", ns) as store:
            pages = random_pages(2)
            assert store.set(keys, [[p] for p in pages]) == 2
            assert read_pages(store, keys)[0] == 2
        with open_store(f"redis://kv:wrong@127.0.0.1:{server.port}/0", ns, retry_interval=0) as store:
            assert read_pages(store, keys)[0] == 0              # refused: a counted error, never an exception
            assert store.stats()["errors.get"] == 1
    finally:
        server.close()


def test_ttl_expires_pages(redis_url):
    ns = namespace()
    with open_store(redis_url, ns, ttl=1) as store:
        keys = page_keys(ns, np.arange(GEOMETRY.page_size))
        store.set(keys, [[random_pages(1)[0]]])
        assert 0 < store.client().ttl(store.key(keys[0])) <= 1


def test_cluster_nodes_really_hold_the_pages(redis_cluster_url):
    ns = namespace()
    with open_store(redis_cluster_url, ns) as store:
        keys = page_keys(ns, np.arange(30 * GEOMETRY.page_size))
        store.set(keys, [[p] for p in random_pages(30)])
        counts = []
        for node in store.client().get_primaries():
            out = subprocess.run([CLI, "-p", str(node.port), "--scan", "--pattern", f"kvtier:{store.namespace_id}:p:*"],
                                 capture_output=True, text=True, check=True)
            counts.append(len(out.stdout.split()))
        assert sum(counts) == 30 and all(counts)
        store.clear()


def test_tls_with_a_rediss_url():
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a certificate)")
    server = RedisServer(tls=True)
    try:
        ns = namespace()
        keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
        pages = random_pages(3)
        with open_store(server.url, ns) as store:
            assert store.set(keys, [[p] for p in pages]) == 3
            count, out = read_pages(store, keys)
            assert count == 3 and all(np.array_equal(a, b) for a, b in zip(out, pages, strict=False))
            assert store.stats().get("errors.set", 0) == 0
        plain = server.url.replace("rediss://", "redis://").split("?")[0]
        with open_store(plain, ns, retry_interval=0, timeout=0.5) as store:
            assert read_pages(store, keys)[0] == 0               # plain text to a TLS port: an error, counted
    finally:
        server.close()


def test_the_cache_keeps_serving_right_kv_while_its_redis_is_down(own_server, runtime):
    from helpers.cache import build, close_all, serve

    stores = []

    def storage(ns):
        stores.append(RedisStore(own_server.url, ns, retry_interval=0.2, timeout=0.5, connect_timeout=0.3))
        return stores[-1]

    prompts = [np.random.default_rng().integers(0, 50000, 4 * n) for n in (6, 9, 5)]
    cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage)
    salt = model.salt
    try:
        for p in prompts:
            serve(cache, model, p)
        cache.drain()
        own_server.stop()
        for p in prompts + [np.random.default_rng().integers(0, 50000, 24)]:
            cache.prefetch(p).settle("wait_complete")        # misses, counted; no exception
            serve(cache, model, p)                          # device and host tiers serve, bytes checked
        cache.drain()
        stats = cache.stats()
        assert sum(v for k, v in stats.items() if k.startswith("storage.errors.")) >= 1
    finally:
        close_all(cache, dev, host)
    own_server.start()                                      # back, empty: the next cache writes and hits again
    time.sleep(0.25)
    cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage)
    model.salt = salt
    try:
        serve(cache, model, prompts[0])
        cache.drain()
    finally:
        close_all(cache, dev, host)
    cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage)
    model.salt = salt
    try:
        fetch = cache.prefetch(prompts[0])
        assert fetch.settle("wait_complete") == len(prompts[0]) and fetch.outcome == "complete"
        serve(cache, model, prompts[0])
    finally:
        close_all(cache, dev, host)
        for store in stores:
            store.close()


def recorded_models(url: str, capsys) -> dict[str, str | None]:
    """Namespace id → model, as ``kvtier storage ls`` shows them."""
    assert main(["storage", "ls", url, "--json"]) == 0
    return {row["namespace"]: row["model"] for row in json.loads(capsys.readouterr().out)}


@pytest.mark.parametrize("outage_seen", [True, False], ids=["outage-seen", "idle-restart"])
def test_the_namespace_record_is_back_after_a_restart_that_lost_it(own_server, capsys, outage_seen):
    """A server restarted empty (``--save ''``) loses the record with the pages. Whether the store saw the outage
    (calls failed meanwhile) or not (the restart happened between calls and redis-py reconnected silently), the
    next write records the namespace again."""
    ns = namespace(model="restart/record")
    store = RedisStore(own_server.url, ns, retry_interval=0, timeout=2.0, connect_timeout=1.0)
    keys = page_keys(ns, np.arange(4 * GEOMETRY.page_size))
    pages = random_pages(4)
    assert store.set(keys[:2], [[p] for p in pages[:2]]) == 2
    assert recorded_models(own_server.url, capsys) == {store.namespace_id: "restart/record"}
    own_server.stop()
    if outage_seen:
        assert store.exists(keys) == 0 and store.stats()["errors.exists"] == 1
    own_server.start()
    assert recorded_models(own_server.url, capsys) == {}
    assert store.set(keys[2:], [[p] for p in pages[2:]]) == 2
    assert recorded_models(own_server.url, capsys) == {store.namespace_id: "restart/record"}
    count, out = read_pages(store, keys[2:])
    assert count == 2 and all(np.array_equal(a, b) for a, b in zip(out, pages[2:], strict=True))
    store.close()


def test_a_namespace_record_deleted_or_evicted_is_written_again_with_the_next_pages(own_server, capsys):
    ns = namespace(model="evicted/record")
    with RedisStore(own_server.url, ns) as store:
        keys = page_keys(ns, np.arange(2 * GEOMETRY.page_size))
        assert store.set(keys[:1], [[random_pages(1)[0]]]) == 1
        store.client().delete(f"kvtier:{store.namespace_id}:namespace")       # as allkeys-lru would
        assert store.set(keys[1:], [[random_pages(1)[0]]]) == 1
    assert recorded_models(own_server.url, capsys) == {store.namespace_id: "evicted/record"}


def test_a_cluster_node_restarted_empty_gets_the_namespace_record_back():
    """The record lives on the one node owning its slot; that node restarted with nothing saved loses it, and the
    store's next write puts it back there."""
    cluster = RedisClusterServers()
    try:
        ns = namespace(model="cluster/record")
        store = open_store(cluster.url, ns, retry_interval=0, timeout=2.0, connect_timeout=1.0)
        record = f"kvtier:{store.namespace_id}:namespace"
        keys = page_keys(ns, np.arange(40 * GEOMETRY.page_size))
        assert store.set(keys[:20], [[p] for p in random_pages(20)]) == 20
        port = store.client().get_node_from_key(record).port
        owner = next(s for s in cluster.servers if s.port == port)
        assert json.loads(redis.Redis(port=port).get(record))["model"] == "cluster/record"
        owner.stop()
        owner.start()
        cluster.wait_ok()
        assert redis.Redis(port=port).get(record) is None
        deadline = time.monotonic() + 60                 # the client finds the cluster again
        while store.set(keys[20:], [[p] for p in random_pages(20)]) != 20:
            assert time.monotonic() < deadline, store.last_error
            time.sleep(0.2)
        assert json.loads(redis.Redis(port=port).get(record))["model"] == "cluster/record"
        store.close()
    finally:
        cluster.close()


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


def test_listing_and_clearing_skip_past_a_key_of_the_wrong_type(redis_url):
    """A list where a page should be (another program's, or a crash's leftover) must not stop ``kvtier storage
    ls/stats/clear`` for every namespace on the server: it is no page, and clearing removes it."""
    ns = namespace()
    with open_store(redis_url, ns) as store:
        keys = page_keys(ns, np.arange(3 * GEOMETRY.page_size))
        store.set(keys[:2], [[p] for p in random_pages(2)])
        store.client().rpush(store.key(keys[2]), b"not a page")
        mine = [e for e in store.entries() if e.namespace == store.namespace_id]
        assert sorted(e.key for e in mine) == sorted(k.hex() for k in keys[:2])
        assert store.clear() == 3 and store.client().exists(store.key(keys[2])) == 0


@pytest.mark.slow
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
