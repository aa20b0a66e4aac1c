"""Nothing raises into SGLang's controller threads: a damaged page is a miss (never KV), a store that goes away turns
into misses and skipped writes and comes back by itself, and a call with bad arguments fails as a whole, logged and
counted, with nothing read or written."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from helpers import sglang as sg
from helpers.storage import RedisServer


def _page_file(store_dir: Path, key: str) -> Path:
    found = [p for p in store_dir.rglob("*") if p.is_file() and key in p.name]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_page_is_a_miss_and_is_written_again(tmp_path, backends, damage):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(f"file:{tmp_path / 'store'}", pool)
    backends.append(backend)
    keys, indices, expected = sg.store_pages(backend, pool, salt="failures")
    path = _page_file(tmp_path / "store", keys[2])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-100:]
    path.write_bytes(bytes(data))
    assert backend.batch_get_v1(keys, indices) == [True, True, False, False]
    reason = "corrupt" if damage == "flip" else "short"
    assert backend.store.stats().get(f"miss.{reason}") == 1
    sg.restore_pages(pool, indices, expected)
    assert backend.batch_set_v1(keys, indices) == [True] * 4      # the bad page was removed: written again
    assert sg.reads_back(backend, pool, keys, indices, expected)


def test_a_damaged_redis_value_is_a_miss(redis_url, backends):
    import redis

    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(redis_url, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, salt="failures")
    client = redis.Redis.from_url(redis_url)
    stored = [k for k in client.scan_iter(count=1000) if keys[1].encode() in k]
    assert len(stored) == 1
    value = bytearray(client.get(stored[0]))
    value[-1] ^= 0xFF
    client.set(stored[0], bytes(value))
    assert backend.batch_get_v1(keys, indices) == [True, False, False, False]
    assert backend.store.stats().get("miss.corrupt") == 1


def test_a_redis_server_that_goes_away_gives_misses_then_comes_back(backends):
    server = RedisServer()
    try:
        pool = sg.mha_host_pool("page_first")
        backend = sg.create_backend(server.url, pool, store_options={"retry_interval": 0.2, "timeout": 1.0})
        backends.append(backend)
        keys, indices, expected = sg.store_pages(backend, pool, salt="failures")
        server.stop()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, indices) == [False] * 4
        assert backend.batch_set_v1(sg.page_keys(2, "while-down"), sg.pages_at(pool, 2)) == [False, False]
        assert backend.stats()["calls"]["get.refused"] == 0           # misses, not refusals
        server.start()                                                 # empty: nothing was saved
        time.sleep(0.3)
        sg.restore_pages(pool, indices, expected)
        assert backend.batch_set_v1(keys, indices) == [True] * 4
        assert sg.reads_back(backend, pool, keys, indices, expected)
        assert backend.store.stats().get("reconnects", 0) >= 1
    finally:
        server.close()


def test_a_mooncake_master_killed_mid_run_gives_misses_then_comes_back(mooncake_servers, backends):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(mooncake_servers.spec, pool,
                                store_options={"retry_interval": 0.2, "connect_timeout": 0.3})
    backends.append(backend)
    keys, indices, expected = sg.store_pages(backend, pool, salt="failures")
    mooncake_servers.stop_master()
    started = time.monotonic()
    assert backend.batch_get_v1(keys, indices) == [False] * 4
    assert backend.batch_exists(keys) == 0
    assert time.monotonic() - started < 30
    mooncake_servers.start_master()                    # back, empty
    mooncake_servers.wait_segment()
    deadline = time.monotonic() + 60
    sg.restore_pages(pool, indices, expected)
    while backend.batch_set_v1(keys, indices) != [True] * 4:
        assert time.monotonic() < deadline, backend.store.last_error
        time.sleep(0.5)
    assert sg.reads_back(backend, pool, keys, indices, expected)


BAD_CALLS = {
    "too few host indices": lambda b, keys, idx: b.batch_get_v1(keys, idx[:-1]),
    "too many host indices": lambda b, keys, idx: b.batch_set_v1(keys[:-1], idx),
    "indices past the pool": lambda b, keys, idx: b.batch_get_v1(keys, idx + 10_000_000),
    "negative indices": lambda b, keys, idx: b.batch_set_v1(keys, idx - 10_000_000),
    "2-D indices": lambda b, keys, idx: b.batch_get_v1(keys, idx.reshape(len(keys), -1)),
    "a key that is not a string": lambda b, keys, idx: b.batch_set_v1([*keys[:-1], 7], idx),
    "no indices": lambda b, keys, idx: b.batch_get_v1(keys, None),
    "a flat page of the wrong size": lambda b, keys, idx: b.batch_get(keys[:1], [torch.zeros(3)]),
    "fewer flat pages than keys": lambda b, keys, idx: b.batch_set(keys, [torch.zeros(3)]),
}


@pytest.mark.parametrize("bad", sorted(BAD_CALLS))
def test_a_bad_call_fails_whole_without_raising_or_touching_anything(file_spec, backends, bad, caplog):
    pool = sg.mha_host_pool("page_first")
    backend = sg.create_backend(file_spec, pool)
    backends.append(backend)
    keys, indices, _ = sg.store_pages(backend, pool, pages=3, salt="failures")
    before = (sg.page_bytes(pool, indices), backend.store.stats().get("set.pages"))
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        answer = BAD_CALLS[bad](backend, keys, indices)
    assert answer in ([False] * 3, [False] * 2, [None], False)
    assert (sg.page_bytes(pool, indices), backend.store.stats().get("set.pages")) == before
    assert sum(v for k, v in backend.stats()["calls"].items() if k.endswith("refused")) == 1
    assert "failed" in caplog.text


def test_calls_before_registration_and_after_close_are_failures_not_exceptions(file_spec):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    pool = sg.mha_host_pool("page_first")
    config = sg.storage_config()
    config.extra_config = sg.extra_config(file_spec)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    keys, indices = sg.page_keys(2), sg.pages_at(pool, 2)
    assert backend.batch_get_v1(keys, indices) == [False, False] and backend.batch_exists(keys) == 0
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(keys, indices) == [True, True]
    backend.close()
    backend.close()                                             # idempotent
    assert backend.batch_get_v1(keys, indices) == [False, False]
    assert backend.batch_set_v1(keys, indices) == [False, False]
    assert backend.batch_exists(keys) == 0 and backend.exists(keys[0]) is False
    assert backend.batch_exists_v2(keys).kv_hit_pages == 0
    assert backend.clear() is False
