"""Hybrid models (Mamba / linear attention beside KV): SGLang's v2 calls store a request's state with its KV pages,
as kvtier's verified state snapshots, and find the longest prefix whose pages and trailing state are both stored."""

from __future__ import annotations

import pytest
import torch
from helpers import sglang as sg


@pytest.fixture
def hybrid_backend(spec, backends):
    """A backend with SGLang's real KV and Mamba host pools registered as its hybrid controller does."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv, mamba = sg.mha_host_pool("page_first"), sg.mamba_host_pool()
    backend = sg.create_backend(spec, kv)
    backends.append(backend)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    backend.on_host_pools_registered()
    return backend, kv, mamba


def _transfers(keys, kv_indices, state_keys, slots):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return [PoolTransfer(PoolName.KV, host_indices=kv_indices, keys=keys),
            PoolTransfer(PoolName.MAMBA, host_indices=slots, keys=state_keys, hit_policy=PoolHitPolicy.TRAILING_PAGES)]


def test_kv_and_state_round_trip_byte_exact(hybrid_backend):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend, kv, mamba = hybrid_backend
    keys, kv_at = sg.page_keys(4, "hybrid_backend"), sg.pages_at(kv, 4)
    slots = mamba.alloc(1)
    sg.fill_pages(kv, kv_at, seed=31)
    sg.fill_pages(mamba, slots, seed=32)
    kv_bytes, state_bytes = sg.page_bytes(kv, kv_at), sg.page_bytes(mamba, slots)
    written = backend.batch_set_v2(_transfers(keys, kv_at, keys[-1:], slots))
    assert written == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}

    found = backend.batch_exists_v2(keys, _transfers(keys, kv_at, keys[-1:], slots)[1:])
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (4, [4])
    assert found.extra_pool_hit_pages[PoolName.MAMBA] == 4

    sg.poison_pages(kv, kv_at)
    sg.poison_pages(mamba, slots)
    read = backend.batch_get_v2(_transfers(keys, kv_at, keys[-1:], slots))
    assert read == {PoolName.KV: [True] * 4, PoolName.MAMBA: [True]}
    assert sg.page_bytes(kv, kv_at) == kv_bytes and sg.page_bytes(mamba, slots) == state_bytes


def test_the_prefix_ends_where_a_state_was_stored(hybrid_backend):
    """States after pages 2 and 4 of 5: the usable prefixes are 2 and 4; with page 4's KV gone only 2 remains."""
    backend, kv, mamba = hybrid_backend
    keys, kv_at, slots = sg.page_keys(5, "ends"), sg.pages_at(kv, 5), mamba.alloc(2)
    sg.fill_pages(kv, kv_at, seed=41)
    sg.fill_pages(mamba, slots, seed=42)
    state_keys = [keys[1], keys[3]]
    result = backend.batch_set_v2(_transfers(keys, kv_at, state_keys, slots))
    assert all(all(v) for v in result.values())
    probe = _transfers(keys, kv_at, keys[-1:], slots[:1])[1:]
    found = backend.batch_exists_v2(keys, probe)
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (4, [2, 4])

    shorter = keys[:3] + sg.page_keys(2, "other")
    found = backend.batch_exists_v2(shorter, probe)
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (2, [2])


def test_a_state_is_stored_as_a_verified_snapshot_of_its_own_format(hybrid_backend):
    from kvtier.integrations.sglang import page_key
    from kvtier.integrations.sglang.storage import state_keys

    backend, kv, mamba = hybrid_backend
    keys, kv_at, slots = sg.page_keys(1, "format"), sg.pages_at(kv, 1), mamba.alloc(1)
    sg.fill_pages(kv, kv_at, seed=1)
    sg.fill_pages(mamba, slots, seed=2)
    backend.batch_set_v2(_transfers(keys, kv_at, keys, slots))
    store = backend.store
    snapshot = state_keys(backend._bound["mamba"].pool.state)(keys[0])
    assert store.present([page_key(keys[0]), snapshot]) == [True, True]
    assert store.stats().get("state.set.pages") == 1


def test_a_pool_kvtier_does_not_store_has_no_hits_and_its_transfers_fail(hybrid_backend, caplog):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    backend, kv, mamba = hybrid_backend
    backend.register_mem_host_pool_v2(mamba, PoolName.SWA)       # not a pool kvtier stores: logged, left out
    keys, kv_at = sg.page_keys(2, "swa"), sg.pages_at(kv, 2)
    swa = PoolTransfer(PoolName.SWA, host_indices=torch.arange(2), keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    result = backend.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=kv_at, keys=keys), swa])
    assert result == {PoolName.KV: [True, True], PoolName.SWA: [False, False]}
    found = backend.batch_exists_v2(keys, [swa])
    assert (found.kv_hit_pages, found.restorable_prefix_pages) == (0, [])
