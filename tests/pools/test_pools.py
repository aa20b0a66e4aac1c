"""Pool geometry, layouts, slots, budget and page metadata."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import KvtierError
from kvtier.pools import HostLayout, HostPool, KVGeometry, PageSlotAllocator, SlotError, host_strides


@pytest.mark.parametrize("row", [64, 576, 656, 1152, 2048])
def test_row_sizes_from_64_bytes_in_multiples_of_16(row):
    assert KVGeometry.mla(61, latent_bytes=row, page_size=16).row_bytes == row


@pytest.mark.parametrize("kwargs", [dict(latent_bytes=48), dict(latent_bytes=100), dict(latent_bytes=0)])
def test_bad_rows_are_refused(kwargs):
    with pytest.raises(KvtierError):
        KVGeometry.mla(4, page_size=16, **kwargs)


def test_heads_must_split_rows_evenly():
    with pytest.raises(KvtierError, match="heads"):
        KVGeometry("mha", 2, 16, row_bytes=96, heads=5)


@pytest.mark.parametrize("layout", list(HostLayout))
def test_layouts_place_every_piece_exactly_once(layout):
    g = KVGeometry.mha(3, kv_heads=2, head_dim=16, itemsize=2, page_size=4)
    pages = 5
    s = host_strides(g, layout, pages)
    seen = np.zeros(pages * g.layers * g.page_bytes, np.int32)
    for layer in range(g.layers):
        for page in range(pages):
            for slot in range(g.page_size):
                for head in range(g.heads):
                    start = layer * s.layer + page * s.page + slot * s.slot + head * s.head
                    seen[start:start + g.head_bytes] += 1
    assert (seen == 1).all()


def test_page_metadata_is_cpu_domain_and_covers_each_page(split):
    g = KVGeometry.mha(2, kv_heads=2, head_dim=16, itemsize=2, page_size=4)
    for layout in HostLayout:
        pool = HostPool.allocate(g, layout, pages=6, runtime=split)
        try:
            meta = pool.page_metadata([5, 0])
            cpu = pool.buffer.cpu_address
            for pieces in meta:
                assert sum(size for _, size in pieces) == g.bytes_per_page // 1
                assert all(0 <= address - cpu < pool.buffer.nbytes for address, _ in pieces)
            with pytest.raises(KvtierError, match="out of range"):
                pool.page_metadata([6])
        finally:
            pool.close()


def test_sizing(split):
    g = KVGeometry.mla(4, latent_bytes=576, page_size=16)
    for kwargs, pages in [(dict(pages=3), 3), (dict(tokens=33), 3), (dict(nbytes=3 * g.bytes_per_page + 5), 3)]:
        pool = HostPool.allocate(g, "page_first", runtime=split, **kwargs)
        assert pool.pages == pages
        pool.close()
    with pytest.raises(KvtierError, match="exactly one"):
        HostPool.allocate(g, "page_first", pages=1, tokens=16, runtime=split)


def test_host_budget_is_checked_before_allocating(split):
    g = KVGeometry.mla(61, latent_bytes=1152, page_size=64)
    with pytest.raises(KvtierError, match="exceeds the budget"):
        HostPool.allocate(g, "page_first", nbytes=1 << 50, runtime=split)


def test_slots_prefer_contiguous_runs_and_catch_bad_frees():
    slots = PageSlotAllocator(16)
    a = slots.allocate(4)
    b = slots.allocate(4)
    assert a == [0, 1, 2, 3] and b == [4, 5, 6, 7]
    slots.free([1, 2])
    assert slots.allocate(2) == [1, 2]
    slots.free(a)
    with pytest.raises(SlotError, match="double free"):
        slots.free([0])
    with pytest.raises(SlotError, match="does not belong"):
        slots.free([16])
    with pytest.raises(SlotError, match="twice"):
        slots.free([4, 4])
    assert slots.free_pages == 12
    with pytest.raises(SlotError, match="cannot allocate"):
        slots.allocate(13)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=40))
def test_slots_never_hand_out_a_page_twice(ops):
    slots, held = PageSlotAllocator(32), []
    for allocate, count in ops:
        if allocate and slots.can_allocate(count):
            got = slots.allocate(count)
            assert not set(got) & set(held) and len(set(got)) == count
            held += got
        elif held:
            give = held[:count]
            slots.free(give)
            held = held[count:]
        assert slots.free_pages == 32 - len(held)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_page_pieces_are_the_page_spans_of_every_page(layout):
    """The vectorised offsets storage views are cut from agree with page_spans / page_metadata, page by page."""
    from kvtier.pools import HostPool, KVGeometry
    from kvtier.runtime import create

    geometry = KVGeometry.mha(layers=5, kv_heads=2, head_dim=32, itemsize=2, page_size=4)
    with contextlib.closing(HostPool.allocate(geometry, layout, pages=12, kind="pinned",
                                              runtime=create("emulated:unified"))) as host:
        pages = [11, 0, 7, 7, 3]
        offsets, sizes = host.page_pieces(pages)
        assert [list(zip(row, sizes.tolist(), strict=True)) for row in offsets.tolist()] == \
            [host.page_spans(p) for p in pages]
        base = host.buffer.cpu_address.value
        assert [[(a.value - base, n) for a, n in page] for page in host.page_metadata(pages)] == \
            [host.page_spans(p) for p in pages]
        with pytest.raises(Exception, match="out of range|page"):
            host.page_pieces([12])


def test_payload_order_codes_are_equal_exactly_when_byte_orders_are():
    """Regression: a 16-bit hash of the order let page_head and layer_first share a code for some geometries (e.g. 4
    heads, 16-token pages, 99 layers), and storage served one's pages scrambled to the other."""
    from kvtier.pools import HostLayout, KVGeometry, host_strides, payload_order

    def byte_order(geometry, layout):
        s = host_strides(geometry, layout, 2)
        layer, slot, head = np.meshgrid(np.arange(geometry.layers), np.arange(geometry.page_size),
                                        np.arange(geometry.heads), indexing="ij")
        return np.argsort(layer * s.layer + slot * s.slot + head * s.head, axis=None, kind="stable").tobytes()

    geometries = [KVGeometry.mha(layers=layers, kv_heads=heads, head_dim=32, itemsize=2, page_size=page)
                  for layers in (1, 2, 7, 24, 99) for heads in (1, 4, 6, 8) for page in (1, 12, 16, 34)]
    geometries += [KVGeometry.mla(layers=61, latent_bytes=1152, page_size=64)]
    for geometry in geometries:
        for a, b in itertools.combinations(list(HostLayout), 2):
            same = byte_order(geometry, a) == byte_order(geometry, b)
            assert (payload_order(geometry, a) == payload_order(geometry, b)) == same, (geometry, a, b)
    llama99 = KVGeometry.mha(layers=99, kv_heads=4, head_dim=32, itemsize=2, page_size=16)
    assert payload_order(llama99, "layer_first") != payload_order(llama99, "page_head")


def test_slot_free_of_a_float_page_changes_nothing():
    """free([1.7]) silently frees page 1 (int() truncation): a caller's bad index releases a live slot.
    (found adversarially)"""
    slots = PageSlotAllocator(8)
    assert slots.allocate(3) == [0, 1, 2]
    with pytest.raises(KvtierError):
        slots.free([1.7])
    assert slots.free_pages == 5


def test_slot_allocator_refuses_non_integer_counts():
    """PageSlotAllocator(2.5) is built; allocate(2.5) dies with a bare TypeError; allocate(True) takes a page.
    (found adversarially)"""
    with pytest.raises(KvtierError):
        PageSlotAllocator(2.5)
    slots = PageSlotAllocator(8)
    for count in (2.5, True):
        with pytest.raises(KvtierError):
            slots.allocate(count)
    assert slots.free_pages == 8
