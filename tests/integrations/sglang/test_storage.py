"""KVTierStorage as SGLang builds and calls it: through SGLang's own backend factory, over SGLang's real host pools
(MHA and MLA, every host layout kvtier stores), on real stores (a directory, Redis, Mooncake). Every page read back is
compared byte for byte with what was written, into destinations poisoned first."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import sglang as sg
from helpers.paths import ROOT, TESTS

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
POOLS = {"mha": sg.mha_host_pool, "mla": sg.mla_host_pool}


def test_sglang_factory_builds_it_from_the_extra_config(file_spec, backends):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from kvtier.integrations.sglang import KVTierStorage

    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    assert isinstance(backend, KVTierStorage) and isinstance(backend, HiCacheStorage)
    assert backend.mem_pool_host is pool


@pytest.mark.parametrize("extra, message", [
    ({}, '"store"'),
    ({"store": ""}, '"store"'),
    ({"store": "/tmp/no-scheme"}, "no scheme"),
    ({"store": "file:/tmp/x", "store_options": {"max_bytez": 1}}, "max_bytez"),
    ({"store": "file:/tmp/x", "tenant": 3}, "tenant"),
    ({"store": "file:/tmp/x", "skip_existing": "yes"}, "skip_existing"),
])
def test_a_bad_extra_config_fails_the_attach_naming_the_option(extra, message, tmp_path):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = sg.mha_host_pool("page_first")
    config = sg.storage_config()
    config.extra_config = {**sg.extra_config("file:" + str(tmp_path)), **extra}
    if "store" not in extra:
        del config.extra_config["store"]
    with pytest.raises(ValueError, match=message):
        backend = StorageBackendFactory.create_backend("dynamic", config, pool)
        backend.register_mem_pool_host(pool)


def test_without_a_model_name_it_asks_for_one(file_spec):
    pool = sg.mha_host_pool("page_first")
    with pytest.raises(ValueError, match='set "model"'):
        sg.create_backend(file_spec, pool, config=sg.storage_config(model_name=None))


@pytest.mark.parametrize("kind", sorted(POOLS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_copy_round_trip_is_byte_exact(spec, kind, layout, backends):
    pool = POOLS[kind](layout)
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool)
    assert backend.batch_exists(keys) == len(keys)
    assert backend.batch_get_v1(keys, indices) == [True] * len(keys)
    assert sg.page_bytes(pool, indices) == written


@pytest.mark.parametrize("kind", sorted(POOLS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flat_pages_and_zero_copy_store_the_same_bytes(file_spec, kind, layout, backends):
    """SGLang's generic path (without interface_v1) hands flat page tensors; a page stored either way reads back
    either way."""
    pool = POOLS[kind](layout)
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool, pages=3)
    flats = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, flats)
    assert [t is f for t, f in zip(got, flats, strict=True)] == [True] * 3
    for i, flat in enumerate(flats):
        pool.set_from_flat_data_page(int(indices[i * pool.page_size]), flat)
    assert sg.page_bytes(pool, indices) == written

    more, more_indices = sg.page_keys(2, "flat"), sg.pages_at(pool, 2)
    sg.fill_pages(pool, more_indices, seed=7)
    again = sg.page_bytes(pool, more_indices)
    values = [pool.get_data_page(int(more_indices[i * pool.page_size])) for i in range(2)]
    assert backend.batch_set(more, values) is True and backend.set(more[0], values[0]) is True
    sg.poison_pages(pool, more_indices)
    assert backend.batch_get_v1(more, more_indices) == [True, True]
    assert sg.page_bytes(pool, more_indices) == again
    assert backend.exists(more[1]) and not backend.exists(sg.page_keys(1, "never")[0])
    assert backend.get(sg.page_keys(1, "never")[0], pool.get_dummy_flat_data_page()) is None


def test_a_read_stops_at_the_first_missing_page(spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    keys, indices = sg.page_keys(4), sg.pages_at(pool, 4)
    sg.fill_pages(pool, indices, seed=3)
    head = indices[:2 * pool.page_size]
    first_two = sg.page_bytes(pool, head)
    assert backend.batch_set_v1(keys, indices) == [True] * 4
    sg.poison_pages(pool, indices)
    chain = keys[:2] + sg.page_keys(1, "hole") + keys[3:]
    assert backend.batch_exists(chain) == 2
    assert backend.batch_get_v1(chain, indices) == [True, True, False, False]
    assert sg.page_bytes(pool, head) == first_two


def test_pages_already_stored_are_not_written_again(file_spec, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, pages=3)
    stored = backend.store.stats().get("set.pages", 0)
    assert backend.batch_set_v1(keys, indices) == [True] * 3
    assert backend.store.stats().get("set.pages", 0) == stored
    assert backend.stats()["calls"]["set.skipped"] == 3


@pytest.mark.slow                                   # a fresh process imports SGLang: about 8 s
def test_a_second_process_reads_what_the_first_stored(spec, backends, tmp_path):
    """Two SGLang instances of one model sharing a store: one sets, the other gets every byte."""
    tenant = "shared-" + tmp_path.name
    child = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / 'helpers' / 'placeholders')!r}]
        from helpers import sglang as sg
        pool = sg.mha_host_pool("page_first")
        backend = sg.create_backend({spec!r}, pool, tenant={tenant!r})
        keys, indices = sg.page_keys(6, "two-processes"), sg.pages_at(pool, 6)
        sg.fill_pages(pool, indices, seed=99)
        assert backend.batch_set_v1(keys, indices) == [True] * 6
        backend.close()
    """)
    done = subprocess.run([sys.executable, "-c", child], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(spec, pool, tenant=tenant)
    backends.append(backend)
    keys, indices = sg.page_keys(6, "two-processes"), sg.pages_at(pool, 6)
    sg.fill_pages(pool, indices, seed=99)
    expected = sg.page_bytes(pool, indices)
    sg.poison_pages(pool, indices)
    assert backend.batch_exists(keys) == 6
    assert backend.batch_get_v1(keys, indices) == [True] * 6
    assert sg.page_bytes(pool, indices) == expected


def test_stats_come_in_sglangs_shape_once_per_call(file_spec, backends):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, pages=3)
    backend.batch_get_v1(keys, indices)
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert all(rate > 0 for rate in stats.backup_bandwidth + stats.prefetch_bandwidth)
    assert stats.kvtier["calls"]["get.hit"] == 3 and stats.kvtier["store"]["get.hit_pages"] == 3
    assert backend.get_stats().prefetch_pgs == []
    scraped = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in backend.metrics.registry.collect() for s in family.samples}
    assert scraped[("kvtier_hicache_pages_total", (("op", "get"), ("outcome", "hit")))] == 3
    assert scraped[("kvtier_hicache_store_events_total", (("event", "get.hit_pages"),))] == 3


def test_mooncake_moves_pages_from_the_registered_pool_without_a_copy(mooncake_spec, backends):
    pool = sg.mha_host_pool("layer_first")
    backend = sg.create_backend(mooncake_spec, pool)
    backends.append(backend)
    keys, indices, written = sg.store_pages(backend, pool, pages=4)
    assert backend.batch_get_v1(keys, indices) == [True] * 4
    assert sg.page_bytes(pool, indices) == written
    bounced = lambda: sum(v for name, v in backend.store.stats().items() if "bounce" in name)  # noqa: E731
    assert bounced() == 0 and backend.store.registered
    flat = pool.get_dummy_flat_data_page()            # a tensor of its own, outside the registered pool: one copy
    assert backend.batch_get(keys[:1], [flat]) == [flat] and bounced() == 1
    backend.close()
    assert not backend.store.registered


def test_threads_share_one_backend(spec, backends):
    import threading

    pool = sg.mha_host_pool("page_first", tokens=512)
    backend = sg.create_backend(spec, pool)
    backends.append(backend)
    failures: list[str] = []

    def worker(n: int) -> None:
        for round_ in range(3):
            keys, indices = sg.page_keys(4, f"thread-{n}-{round_}"), sg.pages_at(pool, 4)
            sg.fill_pages(pool, indices, seed=n * 10 + round_)
            written = sg.page_bytes(pool, indices)
            ok = backend.batch_set_v1(keys, indices) == [True] * 4
            sg.poison_pages(pool, indices)
            ok = ok and backend.batch_get_v1(keys, indices) == [True] * 4
            if not ok or sg.page_bytes(pool, indices) != written:
                failures.append(f"thread {n} round {round_}")
            pool.free(indices)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_clear_removes_this_deployments_pages_only(file_spec, backends):
    pool = sg.mha_host_pool("page_first")
    mine = sg.create_backend(file_spec, pool)
    other = sg.create_backend(file_spec, pool)
    backends += [mine, other]
    keys, indices, _ = sg.store_pages(mine, pool, pages=2)
    assert other.batch_set_v1(keys, indices) == [True, True]
    assert mine.clear() is True
    assert mine.batch_exists(keys) == 0 and other.batch_exists(keys) == 2


@pytest.mark.parametrize("layout", ["page_head"])
def test_a_layout_kvtier_does_not_store_is_refused_at_attach(file_spec, layout):
    pool = sg.mha_host_pool(layout)
    with pytest.raises(ValueError, match="page_head"):
        sg.create_backend(file_spec, pool)


def test_keys_index_into_the_namespace_one_to_one():
    from kvtier.integrations.sglang import page_key

    hexkey = sg.page_keys(1)[0]
    assert page_key(hexkey) == bytes.fromhex(hexkey)
    assert len(page_key("custom-key")) == 32 and page_key("custom-key") != page_key("custom-key2")
    with pytest.raises(ValueError):
        page_key(b"bytes")


@pytest.mark.parametrize("prefill, hits", [(1e12, 0), (1.0, 3)], ids=["recompute-faster", "read-faster"])
def test_a_stored_prefix_slower_to_read_than_to_recompute_is_declined(file_spec, backends, prefill, hits):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool, prefill_tokens_per_s=prefill, storage_gbps=1.0)
    backends.append(backend)
    keys, _, _ = sg.store_pages(backend, pool, pages=3)
    assert backend.batch_exists(keys) == hits
    assert backend.batch_exists_v2(keys).kv_hit_pages == hits
    assert backend.stats()["calls"]["exists.declined"] == 2 * (3 - hits)


def test_a_rate_that_is_no_positive_number_is_refused(file_spec):
    pool = sg.mha_host_pool("page_first")
    for bad in (0, -1, "fast", True):
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            sg.create_backend(file_spec, pool, prefill_tokens_per_s=bad)
