"""The cache with a storage tier: write-through from host backups (a node is marked stored only once its pages
reached storage), prefetch into the host tier (committed as it lands, cut at the first bad page), policies, the
recompute decision, degrade-never-fail, sharing between caches and processes. Every served page is checked byte for
byte against the stand-in model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from helpers.cache import build, close_all, serve
from helpers.paths import TESTS
from helpers.storage import Hooked, hooked_stores, memory_stores, second, warm

from kvtier.cache import page_keys
from kvtier.runtime import create
from kvtier.storage import MemoryStore, SharedPages, open_store


def seeded_prompt(pages: int, page_size: int = 4, seed: int | None = None) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, pages * page_size)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct", "page_head"])
def test_a_restarted_cache_is_served_from_storage(runtime, store_spec, layout):
    stores = []
    shared = SharedPages()

    def storage(ns):
        stores.append(MemoryStore(ns, shared=shared, layout=layout) if store_spec == "memory:"
                      else open_store(store_spec, ns, layout=layout))
        return stores[-1]

    prompts = [seeded_prompt(12), seeded_prompt(7)]
    salt = warm(runtime, storage, prompts, layout=layout)
    cache, model, dev, host = second(runtime, storage, salt, layout=layout)
    try:
        for p in prompts:
            fetch = cache.prefetch(p)
            assert fetch.settle("wait_complete") == len(p) and fetch.outcome == "complete"
            match, served = serve(cache, model, p)         # checks every loaded-back byte
            assert match.host_tokens == len(p) and served == len(p) // 4
        cache.check()
        assert cache.stats()["hit_tokens.storage"] == sum(len(p) for p in prompts)
    finally:
        close_all(cache, dev, host)
        for s in stores:
            s.clear()
            s.close()


def test_prefetch_extends_a_host_prefix_and_keeps_the_trees_own_pages(runtime):
    shared = SharedPages()
    base = seeded_prompt(6)
    longer = np.concatenate([base, seeded_prompt(5)])
    salt = warm(runtime, lambda ns: MemoryStore(ns, shared=shared), [longer])
    cache, model, dev, host = second(runtime, lambda ns: MemoryStore(ns, shared=shared), salt)
    try:
        serve(cache, model, base)                          # computed: device (and host after the backup)
        cache.drain()
        fetch = cache.prefetch(longer)
        assert fetch.start_page == 6 and fetch.settle("wait_complete") == 20
        match, served = serve(cache, model, longer)
        assert served == 11
        cache.check()
    finally:
        close_all(cache, dev, host)


@pytest.mark.parametrize("bad_page", [0, 3, 7])
def test_a_corrupt_page_cuts_the_chain_and_nothing_after_it_is_committed(runtime, bad_page):
    storage, stores = memory_stores()

    p = seeded_prompt(10)
    salt = warm(runtime, storage, [p])
    cache, model, dev, host = second(runtime, storage, salt, storage_batch_pages=3)
    try:
        stores[-1].corrupt(page_keys(cache.namespace, p)[bad_page], 200)
        fetch = cache.prefetch(p)
        assert fetch.settle("wait_complete") == bad_page * 4
        assert fetch.outcome == "truncated"
        match = cache.match_prefix(p)
        assert match.cached_tokens == bad_page * 4
        serve(cache, model, p)                             # served prefix checked byte for byte
        assert stores[-1].stats()["miss.corrupt"] == 1
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_a_page_evicted_between_exists_and_get_is_a_gap_not_garbage(runtime):
    storage, stores = hooked_stores()

    p = seeded_prompt(10)
    salt = warm(runtime, storage, [p])
    cache, model, dev, host = second(runtime, storage, salt)
    try:
        stores[-1].vanish_after_exists = 4
        fetch = cache.prefetch(p)
        assert fetch.settle("wait_complete") == 16 and fetch.stored_pages == 10 and fetch.outcome == "truncated"
        assert stores[-1].stats()["miss.absent"] == 1
        serve(cache, model, p)
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_policies_best_effort_wait_complete_and_timeout(runtime):
    storage, stores = hooked_stores()

    prompts = [seeded_prompt(12) for _ in range(3)]
    salt = warm(runtime, storage, prompts)
    cache, model, dev, host = second(runtime, storage, salt, storage_batch_pages=2, prefetch_timeout_base=0.35,
                                     prefetch_timeout_per_1k_tokens=0.0)
    try:
        stores[-1].delay = 0.1                             # 6 batches of 2 pages: ~0.6 s in all
        fetch = cache.prefetch(prompts[0])
        start = time.monotonic()
        got = fetch.settle("best_effort")
        assert time.monotonic() - start < 0.05 and got < 48
        fetch.wait()
        assert fetch.outcome == "cancelled" and fetch.committed_tokens < 48
        assert cache.match_prefix(prompts[0]).host_tokens == fetch.committed_tokens

        fetch = cache.prefetch(prompts[1])
        assert fetch.settle("wait_complete") == 48 and fetch.outcome == "complete"

        fetch = cache.prefetch(prompts[2])
        got = fetch.settle("timeout")
        elapsed = time.monotonic() - fetch.created
        assert 0.3 < elapsed < 0.5 and 0 < got < 48
        fetch.wait()
        assert fetch.outcome == "cancelled"
        for p in prompts:
            serve(cache, model, p)
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_a_finished_prefetch_is_usable_at_once(runtime):
    shared = SharedPages()
    p = seeded_prompt(8)
    salt = warm(runtime, lambda ns: MemoryStore(ns, shared=shared), [p])
    cache, model, dev, host = second(runtime, lambda ns: MemoryStore(ns, shared=shared), salt)
    try:
        fetch = cache.prefetch(p)
        fetch.wait()
        assert fetch.finished_at is not None
        assert cache.match_prefix(p).host_tokens == 32     # no scan, no settle needed
    finally:
        close_all(cache, dev, host)


def test_storage_slower_than_recompute_is_declined(runtime):
    shared = SharedPages()
    p = seeded_prompt(8)
    salt = warm(runtime, lambda ns: MemoryStore(ns, shared=shared), [p])
    cache, model, dev, host = second(runtime, lambda ns: MemoryStore(ns, shared=shared), salt,
                                     storage_gbps=1e-6, prefill_tokens_per_s=1e6)
    try:
        fetch = cache.prefetch(p)
        fetch.wait()
        assert fetch.outcome == "slower_than_recompute" and fetch.committed_tokens == 0
        assert cache.stats()["prefetches.slower_than_recompute"] == 1
    finally:
        close_all(cache, dev, host)


@pytest.mark.parametrize("fail", ["exists", "get", "set"])
def test_a_failing_store_degrades_to_misses_and_the_cache_keeps_serving(runtime, fail):
    storage, stores = hooked_stores()

    p, q = seeded_prompt(8), seeded_prompt(6)
    salt = warm(runtime, storage, [p])
    cache, model, dev, host = second(runtime, storage, salt)
    try:
        stores[-1].fail = fail
        fetch = cache.prefetch(p)
        fetch.settle("wait_complete")
        assert fetch.outcome in ("complete", "miss", "truncated")
        assert (fetch.committed_tokens == 0) == (fail != "set")
        for r in (p, q, p, q):                              # device and host tiers keep serving, bytes checked
            serve(cache, model, r)
        cache.drain()
        stats = cache.stats()
        assert stats[f"storage.errors.{fail}"] >= 1
        if fail == "set":
            assert stats["storage_skipped.store_failed"] >= 1
        stores[-1].fail = None
        time.sleep(1.05)                                   # the default retry interval
        r = seeded_prompt(5)
        serve(cache, model, r)
        cache.drain()
        assert stores[-1].exists(page_keys(cache.namespace, r)) == 5, "writes resume when the store is back"
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_a_full_write_queue_skips_and_counts_instead_of_blocking(runtime):
    shared = SharedPages()
    stores = []

    def storage(ns):
        stores.append(Hooked(ns, shared=shared))
        stores[-1].delay = 0.2
        return stores[-1]

    cache, model, dev, host = build(runtime, device_pages=64, host_pages=128, storage=storage,
                                    storage_queue_pages=4)
    try:
        start = time.monotonic()
        for _ in range(4):
            serve(cache, model, seeded_prompt(3))
        assert time.monotonic() - start < 0.6, "serving never waits for storage"
        cache.drain()
        assert cache.stats()["storage_skipped.queue_full"] >= 3
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_close_during_a_prefetch_and_a_write_returns_every_page(runtime):
    storage, stores = hooked_stores()

    p = seeded_prompt(20)
    salt = warm(runtime, storage, [p])
    cache, model, dev, host = second(runtime, storage, salt, storage_batch_pages=2)
    stores[-1].delay = 0.05
    fetch = cache.prefetch(p)
    serve(cache, model, seeded_prompt(4))                         # a write-through queued behind the slow store
    time.sleep(0.08)
    close_all(cache, dev, host)                            # close checks that no page leaked
    assert fetch.done and fetch.outcome in ("closed", "cancelled", "complete")


def test_host_pages_being_written_are_not_evicted(runtime):
    shared = SharedPages()
    stores = []

    def storage(ns):
        stores.append(Hooked(ns, shared=shared))
        stores[-1].delay = 0.3
        return stores[-1]

    cache, model, dev, host = build(runtime, device_pages=32, host_pages=8, storage=storage)
    try:
        p = seeded_prompt(6)
        serve(cache, model, p)
        deadline = time.monotonic() + 5
        while cache.stats()["queue.storage_write_pages"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.evict(host_pages=8)[1] == 0, "pages storage is reading stay on the host"
        cache.drain()
        assert cache.evict(host_pages=8)[1] == 6
        cache.check()
    finally:
        close_all(cache, dev, host)


def test_two_caches_in_threads_share_one_store(runtime):
    shared = SharedPages()
    errors = []
    prompts = [seeded_prompt(6, seed=s) for s in range(6)]
    salt = np.random.default_rng().bytes(16)

    def user() -> None:
        try:
            cache, model, dev, host = build(runtime, device_pages=64, host_pages=128,
                                            storage=lambda ns: MemoryStore(ns, shared=shared))
            model.salt = salt
            for p in prompts:
                cache.prefetch(p).settle("wait_complete")
                serve(cache, model, p)
            cache.check()
            close_all(cache, dev, host)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=user) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from helpers.cache import build, serve, close_all
    from kvtier.runtime import create
    from kvtier.storage import open_store
    stores = []
    cache, model, dev, host = build(create("emulated:split"), device_pages=64, host_pages=128, model={model!r},
                                    storage=lambda ns: stores.append(open_store({spec!r}, ns)) or stores[-1])
    model.salt = bytes.fromhex({salt!r})
    serve(cache, model, np.array({tokens!r}))
    cache.drain()
    close_all(cache, dev, host)
    stores[0].close()
""")


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_two_processes_share_a_store_and_namespaces_stay_apart(kind, tmp_path, request):
    spec = f"file:{tmp_path}" if kind == "file" else request.getfixturevalue("redis_url")
    salt = np.random.default_rng().bytes(16)
    p = seeded_prompt(9)
    model_name = f"shared-{os.getpid()}-{time.monotonic_ns()}"
    script = CHILD.format(tests=str(TESTS), model=model_name, spec=spec, salt=salt.hex(),
                          tokens=p.tolist())
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    runtime = create("emulated:unified")
    stores = []

    def storage(ns):
        stores.append(open_store(spec, ns))
        return stores[-1]

    for model, expect in ((model_name, 36), (model_name + "-other", 0)):
        cache, kv, dev, host = build(runtime, device_pages=64, host_pages=128, model=model, storage=storage)
        kv.salt = salt
        try:
            assert cache.prefetch(p).settle("wait_complete") == expect
            serve(cache, kv, p)
        finally:
            close_all(cache, dev, host)
    stores[0].clear()
    for s in stores:
        s.close()


def test_prefetch_without_storage_is_finished_at_once(runtime):
    cache, model, dev, host = build(runtime)
    try:
        fetch = cache.prefetch(seeded_prompt(4))
        assert fetch.done and fetch.outcome == "no_storage" and fetch.settle() == 0
    finally:
        close_all(cache, dev, host)


def test_a_store_of_another_namespace_is_refused(runtime):
    from helpers.storage import namespace

    from kvtier.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="storage must be an open StorageBackend of this cache's namespace"):
        build(runtime, storage=lambda ns: MemoryStore(namespace()))


def test_kv_model_salt_is_what_makes_the_checks_real(runtime):
    """Guard for the tests above: a different salt makes the byte checks fail."""
    shared = SharedPages()
    p = seeded_prompt(5)
    warm(runtime, lambda ns: MemoryStore(ns, shared=shared), [p])
    cache, model, dev, host = second(runtime, lambda ns: MemoryStore(ns, shared=shared),
                                     np.random.default_rng().bytes(16))
    try:
        cache.prefetch(p).settle("wait_complete")
        with pytest.raises(AssertionError, match="load-back served wrong KV"):
            serve(cache, model, p)
    finally:
        close_all(cache, dev, host)


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
