"""State snapshots in a store (kvtier.storage.snapshots): every backend stores, reads and verifies them with its page
code, under the state snapshot format; a KV page is never read as a snapshot nor a snapshot as a KV page; a
snapshot of another namespace, state geometry or layout is a counted miss; the view is the store (one down state,
one lifetime)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.storage import namespace, random_pages, read_pages

from kvtier.errors import InvalidArgument
from kvtier.keys import state_key
from kvtier.pools.state import StateGeometry
from kvtier.storage import MemoryStore, SharedPages, open_store
from kvtier.storage.snapshots import state_snapshots
from kvtier.storage.state_format import StateFormat

STATE = StateGeometry.mamba(3, (8, 3), (2, 4, 4))


def snapshots(store, geometry=STATE, layout="page_first"):
    return state_snapshots(store, StateFormat.of(store.namespace, geometry, layout))


def random_slots(count: int, geometry=STATE) -> list[np.ndarray]:
    rng = np.random.default_rng()
    return [rng.integers(1, 256, geometry.slot_bytes, dtype=np.uint8) for _ in range(count)]


def read_slots(view, keys, geometry=STATE) -> tuple[int, list[np.ndarray]]:
    out = [np.full(geometry.slot_bytes, 0x5A, np.uint8) for _ in keys]
    return view.get(keys, [[o] for o in out]), out


def test_state_keys_are_pinned_and_never_a_page_key():
    page_key = bytes(range(32))
    assert state_key(page_key).hex()[:16] == "b1da03884dcd9fab"
    assert state_key(page_key) != page_key and state_key(state_key(page_key)) != state_key(page_key)
    with pytest.raises(InvalidArgument, match="32 bytes"):
        state_key(b"short")


def test_snapshots_round_trip_byte_exact_on_every_backend(store_spec):
    with open_store(store_spec, namespace()) as store:
        view = snapshots(store)
        page_keys = [bytes([i]) * 32 for i in range(1, 4)]
        keys = [state_key(k) for k in page_keys]
        data = random_slots(3)
        assert view.set(keys, [[d] for d in data]) == 3
        assert view.present([keys[1], page_keys[0], keys[2]]) == [True, False, True]
        count, out = read_slots(view, keys)
        assert count == 3 and all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
        assert view.stats()["get.hit_pages"] == 3 and store.stats()["state.get.hit_pages"] == 3
        store.clear()


def test_a_kv_page_is_never_read_as_a_snapshot_nor_a_snapshot_as_a_kv_page(store_spec):
    with open_store(store_spec, namespace()) as store:
        view = snapshots(store)
        kv_key, snap_key = b"\x01" * 32, b"\x02" * 32
        assert store.set([kv_key], [[p] for p in random_pages(1)]) == 1
        assert view.set([snap_key], [[s] for s in random_slots(1)]) == 1
        assert read_slots(view, [kv_key])[0] == 0                  # a KV page under the snapshot's read
        assert read_pages(store, [snap_key])[0] == 0               # a snapshot under a KV page's read
        stats = store.stats()
        if store.kind == "mooncake":          # it knows an object's size before reading it: another size, no bytes
            assert stats["state.miss.geometry"] + stats.get("state.miss.short", 0) == 1
            assert stats.get("miss.geometry", 0) + stats.get("miss.short", 0) == 1
        else:
            assert stats["state.miss.kind"] == 1 and stats["miss.kind"] == 1
        store.clear()


@pytest.mark.parametrize("other", ["geometry", "dtype", "layout", "namespace"])
def test_a_snapshot_of_another_namespace_geometry_or_layout_is_a_counted_miss(other):
    shared = SharedPages()
    ns = namespace()
    writer = MemoryStore(ns, shared=shared)
    key = state_key(b"\x03" * 32)
    assert snapshots(writer).set([key], [[s] for s in random_slots(1)]) == 1
    if other == "namespace":                      # the same key read in another namespace's store finds nothing
        reader = MemoryStore(namespace(), shared=shared)
        shared.pages[(reader.namespace_id, key)] = shared.pages[(writer.namespace_id, key)]
        view, reason, geometry = snapshots(reader), "namespace", STATE
    else:
        geometry = {"geometry": StateGeometry.mamba(3, (8, 3), (4, 2, 4)),
                    "dtype": StateGeometry.mamba(3, (8, 3), (2, 4, 8), temporal_dtype="bfloat16"),
                    "layout": STATE}[other]
        view = snapshots(MemoryStore(ns, shared=shared), geometry, "page_first_direct" if other == "layout" else
                         "page_first")
        reason = "layout" if other == "layout" else "geometry"
    assert geometry.slot_bytes == STATE.slot_bytes            # the same length: only the header tells them apart
    count, out = read_slots(view, [key], geometry)
    assert count == 0 and (out[0] == 0x5A).all()
    assert view.stats()[f"miss.{reason}"] == 1


def test_the_view_is_the_store_one_down_state_one_lifetime():
    store = MemoryStore(namespace())
    view = snapshots(store)
    assert view.page_bytes == STATE.slot_bytes != store.page_bytes
    with pytest.raises(InvalidArgument, match="snapshot view already"):
        state_snapshots(view, view.format)
    with pytest.raises(InvalidArgument, match="another namespace"):
        state_snapshots(store, StateFormat.of(namespace(), STATE))
    with pytest.raises(InvalidArgument, match="bytes in its buffers"):
        view.set([state_key(b"\x04" * 32)], [[p] for p in random_pages(1)])     # a KV page is not a slot
    store.close()
    assert view.closed
    with pytest.raises(InvalidArgument, match="open StorageBackend"):
        state_snapshots(store, StateFormat.of(store.namespace, STATE))
