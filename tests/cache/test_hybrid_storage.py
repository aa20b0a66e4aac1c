"""A hybrid cache's storage tier: state snapshots are written through with their KV pages and prefetched with them,
on every backend; a second cache (fresh pools: a restarted process) is served KV and state byte for byte, into pools
poisoned beforehand. A prefix is served from storage only up to the deepest page whose snapshot is stored and
verified: a snapshot deleted, damaged, of another state geometry or never written cuts it there (counted), and a store
that goes down in the middle of a prefetch gives misses, never an exception."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from helpers.cache import P, build, close_all, prompt, serve
from helpers.hybrid import Hybrid
from helpers.storage import Hooked, RedisServer

from kvtier.cache import page_keys
from kvtier.keys import state_key
from kvtier.pools.state import StateGeometry
from kvtier.storage import MemoryStore, SharedPages, open_store
from kvtier.storage.format import STATE_MAGIC
from kvtier.storage.redis_store import RedisStore


class Stores:
    """Stores over one place (a spec, or one dict for ``memory:``), as a restarted process would open it."""

    def __init__(self, spec: str = "memory:", kind: type = MemoryStore, **options) -> None:
        self.spec, self.kind, self.options = spec, kind, options
        self.shared = SharedPages()
        self.tenant = uuid.uuid4().hex                  # tests sharing a server never see each other's pages
        self.made: list = []

    def __call__(self, ns):
        if self.spec == "memory:":
            store = self.kind(ns, shared=self.shared, **self.options)
        elif self.kind is MemoryStore:
            store = open_store(self.spec, ns, **self.options)
        else:
            store = self.kind(self.spec, ns, **self.options)
        self.made.append(store)
        return store

    def close(self) -> None:
        for store in self.made:
            if not store.closed:
                store.clear()
                store.close()


def serve_and_store(runtime, stores, served, **options) -> bytes:
    """A first hybrid cache serves each prompt of ``served`` (KV and a snapshot at its end) and writes them through;
    returns its model's salt, for a second cache to check bytes with."""
    first = Hybrid(runtime, device_pages=48, host_pages=96, device_states=8, host_states=16, storage=stores,
                   tenant=stores.tenant, **options)
    try:
        for tokens in served:
            first.serve(tokens)
        first.cache.drain()
        stats = first.cache.stats()
        assert stats["states.stored"] >= len({len(t) for t in served}) > 0
        assert stats["storage_skipped.store_failed"] == stats["storage_skipped.queue_full"] == 0
    finally:
        first.close()
    return first.model.salt


def restarted(runtime, stores, salt, **options) -> Hybrid:
    """A second cache over the same store, every pool poisoned, whose model checks the first one's bytes."""
    second = Hybrid(runtime, device_pages=48, host_pages=96, device_states=8, host_states=16, storage=stores,
                    tenant=stores.tenant, **options)
    second.model.salt = salt
    second.poison()
    return second


@pytest.mark.parametrize("state_layout", ["page_first", "page_first_direct"])
def test_a_restarted_hybrid_cache_is_served_kv_and_state_from_every_backend(runtime, store_spec, state_layout):
    stores = Stores(store_spec)
    shared = prompt(8 * P)
    long, branch = np.concatenate([shared, prompt(4 * P)]), np.concatenate([shared, prompt(3 * P)])
    try:
        salt = serve_and_store(runtime, stores, [long, branch], state_layout=state_layout)
        second = restarted(runtime, stores, salt, state_layout=state_layout)
        try:
            for tokens in (long, branch):
                fetch = second.cache.prefetch(tokens)
                assert fetch.settle("wait_complete") == len(tokens) - fetch.start_page * P
                assert fetch.outcome == "complete"
                match, served = second.serve(tokens)          # checks every KV byte and every state byte served
                assert served == len(tokens) and match.host_tokens == len(tokens) - match.device_tokens
            second.cache.check()
            stats = second.cache.stats()
            assert stats["states.prefetched"] == 2 and stats["storage.state.get.hit_pages"] == 2
            assert stats["storage.state.get.pages"] == 2       # only the snapshot at each prompt's end was read
        finally:
            second.close()
    finally:
        stores.close()


def staged(runtime, stores) -> tuple[np.ndarray, bytes]:
    """A prompt of 12 pages served as its 12-, 8- and 4-page prefixes (longest first: the later snapshots join KV
    already stored), so storage holds snapshots at pages 4, 8 and 12."""
    tokens = prompt(12 * P)
    salt = serve_and_store(runtime, stores, [tokens, tokens[:8 * P], tokens[:4 * P]])
    return tokens, salt


def snapshot_keys(stores, tokens) -> dict[int, bytes]:
    keys = page_keys(stores.made[0].namespace, tokens)
    return {end: state_key(keys[end - 1]) for end in (4, 8, 12)}


@pytest.mark.parametrize("gone", [(12,), (12, 8), (8,), (12, 8, 4)])
def test_a_deleted_snapshot_cuts_the_served_prefix_to_the_previous_snapshot(runtime, store_spec, gone):
    stores = Stores(store_spec)
    try:
        tokens, salt = staged(runtime, stores)
        keys = snapshot_keys(stores, tokens)
        second = restarted(runtime, stores, salt)
        store = second.cache.storage
        assert store.delete([keys[end] for end in gone]) == len(gone)
        left = max((end for end in (4, 8, 12) if end not in gone), default=0)
        try:
            fetch = second.cache.prefetch(tokens)
            assert fetch.settle("wait_complete") == left * P
            assert fetch.outcome == ("complete" if left else "no_state")
            stats = second.cache.stats()
            assert stats["prefetch_skipped.no_state"] == 12 - left
            assert stats.get("storage.get.hit_pages", 0) == left       # KV past the last snapshot is never read
            match, served = second.serve(tokens)                        # checks every byte served
            assert served == left * P == match.cached_tokens
            second.cache.check()
        finally:
            second.close()
    finally:
        stores.close()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate"])
@pytest.mark.parametrize("bad", [(12,), (12, 8), (12, 8, 4)])
def test_a_damaged_snapshot_is_a_counted_miss_that_cuts_the_prefix(runtime, damage, bad):
    stores = Stores()
    try:
        tokens, salt = staged(runtime, stores)
        keys = snapshot_keys(stores, tokens)
        second = restarted(runtime, stores, salt)
        store = second.cache.storage
        for end in bad:
            if damage == "truncate":
                store.corrupt(keys[end], 0, truncate=200)
            else:
                store.corrupt(keys[end], 300 if damage == "flip_payload" else 22)   # 22: the geometry fingerprint
        left = max((end for end in (4, 8, 12) if end not in bad), default=0)
        try:
            fetch = second.cache.prefetch(tokens)
            assert fetch.settle("wait_complete") == left * P and fetch.outcome == "truncated"
            stats = second.cache.stats()
            reason = {"flip_payload": "corrupt", "flip_header": "geometry", "truncate": "short"}[damage]
            assert stats[f"storage.state.miss.{reason}"] == len(bad)
            match, served = second.serve(tokens)
            assert served == left * P == match.cached_tokens
            second.cache.check()
        finally:
            second.close()
    finally:
        stores.close()


def test_kv_stored_without_a_snapshot_is_not_served(runtime):
    """KV pages of the hybrid model's namespace written by a cache without state (or whose snapshot never made it):
    the hybrid cache reads none of them."""
    stores = Stores()
    tokens = prompt(6 * P)
    stores.tenant = None
    cache, model, dev, host = build(runtime, storage=stores, model="hybrid")
    try:
        serve(cache, model, tokens)
        cache.drain()
        assert cache.stats()["storage_pages.written"] == 6
    finally:
        close_all(cache, dev, host)
    second = restarted(runtime, stores, model.salt)
    try:
        store = second.cache.storage
        assert store.exists(page_keys(second.ns, tokens)) == 6
        fetch = second.cache.prefetch(tokens)
        assert fetch.settle("wait_complete") == 0 and fetch.outcome == "no_state"
        stats = second.cache.stats()
        assert stats["prefetch_skipped.no_state"] == 6 and stats.get("storage.get.pages", 0) == 0
        match, served = second.serve(tokens)
        assert served == 0 and match.cached_tokens == 0
        second.cache.check()
    finally:
        second.close()
        stores.close()


def test_a_snapshot_of_another_state_geometry_is_a_counted_miss(runtime):
    stores = Stores()
    tokens = prompt(5 * P)
    other = StateGeometry.mamba(6, (8, 3), (2, 4, 4), temporal_dtype="bfloat16")    # same KV, another state
    try:
        salt = serve_and_store(runtime, stores, [tokens])
        second = restarted(runtime, stores, salt, state=other)
        try:
            fetch = second.cache.prefetch(tokens)
            assert fetch.settle("wait_complete") == 0 and fetch.outcome == "truncated"
            assert second.cache.stats()["storage.state.miss.geometry"] == 1
            assert second.serve(tokens)[1] == 0
            second.cache.check()
        finally:
            second.close()
    finally:
        stores.close()


@pytest.mark.parametrize("down_at", ["exists", "first_kv_read", "state_read"])
def test_a_store_down_mid_prefetch_gives_misses_never_an_exception(runtime, down_at):
    stores = Stores(kind=Hooked)
    tokens = prompt(12 * P)
    try:
        salt = serve_and_store(runtime, stores, [tokens])
        second = restarted(runtime, stores, salt, storage_batch_pages=4)
        store = second.cache.storage
        if down_at == "exists":
            store.fail = "exists"
        else:
            store.fail_from_read = 1 if down_at == "first_kv_read" else 4    # 3 batches of KV, then the snapshot
        try:
            fetch = second.cache.prefetch(tokens)
            assert fetch.settle("wait_complete") == 0
            assert fetch.outcome == ("miss" if down_at == "exists" else "truncated")
            stats = second.cache.stats()
            assert stats["prefetches.error"] == 0
            assert stats["storage.errors.exists" if down_at == "exists" else
                         "storage.state.errors.get" if down_at == "state_read" else "storage.errors.get"] == 1
            match, served = second.serve(tokens)              # recomputed: nothing served, nothing wrong
            assert served == 0 and match.cached_tokens == 0
            second.cache.check()
        finally:
            second.close()
    finally:
        stores.close()


def test_a_redis_server_stopped_between_the_kv_and_the_snapshot_read_gives_a_miss(runtime):
    server = RedisServer()
    tokens = prompt(6 * P)

    class StopsBeforeTheSnapshot(RedisStore):
        """Stops the real server when the snapshot is about to be read (after the KV pages were)."""

        def _get(self, keys, pages):
            if self.format.magic == STATE_MAGIC:
                server.stop()
            return super()._get(keys, pages)

    first = Stores(server.url, RedisStore)
    second_stores = Stores(server.url, StopsBeforeTheSnapshot, timeout=2, connect_timeout=1)
    second_stores.tenant = first.tenant
    try:
        salt = serve_and_store(runtime, first, [tokens])
        second = restarted(runtime, second_stores, salt)
        try:
            fetch = second.cache.prefetch(tokens)
            assert fetch.settle("wait_complete") == 0 and fetch.outcome == "truncated"
            stats = second.cache.stats()
            assert stats["storage.get.hit_pages"] == 6 and stats["storage.state.errors.get"] == 1
            assert not stats["storage.up"]
            assert second.serve(tokens)[1] == 0
            second.cache.check()
        finally:
            second.close()
    finally:
        for store in first.made + second_stores.made:
            store.close()
        server.close()


class RefusesSnapshots(MemoryStore):
    """A store that fails every write of a state snapshot (and stores KV pages)."""

    def _set(self, keys, pages):
        if self.format.magic == STATE_MAGIC:
            raise ConnectionError("server went away")
        return super()._set(keys, pages)


def test_a_failed_snapshot_write_is_counted_and_its_prefix_not_served_after_a_restart(runtime):
    stores = Stores(kind=RefusesSnapshots)
    tokens = prompt(4 * P)
    first = Hybrid(runtime, storage=stores, tenant=stores.tenant)
    try:
        first.serve(tokens)
        first.cache.drain()
        stats = first.cache.stats()
        assert stats["storage_pages.written"] == 4 and stats["states.stored"] == 0
        assert stats["storage_skipped.store_failed"] == 1 and stats["storage.state.errors.set"] == 1
    finally:
        first.close()
    stores.kind = MemoryStore
    second = restarted(runtime, stores, first.model.salt)
    try:
        fetch = second.cache.prefetch(tokens)
        assert fetch.settle("wait_complete") == 0 and fetch.outcome == "no_state"
        assert second.serve(tokens)[1] == 0
    finally:
        second.close()
        stores.close()
