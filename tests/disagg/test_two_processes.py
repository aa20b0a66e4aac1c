"""A prefill process hands requests' KV to this (decode) process over Mooncake on loopback: two real processes,
each with its own Mooncake engine, every page byte-checked; layouts that differ between the sides; device pools on
both ends (through host staging: the emulator's device memory is no transport's); the decode side's cache serving
the received prefix; two requests in flight at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.cache import build
from helpers.disagg import DEVICE, GEOMETRY, Peer, expected, make_pool, read_kv, request_spec

from kvtier.disagg import KVReceiver
from kvtier.integrations.disagg import receive_prefix

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("mooncake_wheel")]


@pytest.mark.parametrize("src_layout, dst_layout", [
    ("page_first", "page_first"), ("page_first", "layer_first"), ("layer_first", "page_head"),
    (DEVICE, DEVICE), ("page_first_direct", DEVICE), (DEVICE, "page_first")])
def test_a_request_lands_byte_for_byte_across_layouts(rt, src_layout, dst_layout):
    pool = make_pool(GEOMETRY, dst_layout, 32, rt)
    receiver = KVReceiver(pool, dtype="bfloat16")
    src_pages, dst_pages = list(range(3, 19)), [30, 2, *range(10, 24)]
    peer = Peer("prefill", address=receiver.address, runtime=rt.name, layout=src_layout, pages=24,
                staging_pages=4, requests=[request_spec("r1", src_pages, 7)])      # staged in chunks of 2 pages
    try:
        link = receiver.accept(60)
        landing = link.expect("r1", dst_pages)
        assert landing.wait(60).tolist() == dst_pages and landing.landed
        sent = peer.event("sent")
        assert sent["bytes"] == len(dst_pages) * GEOMETRY.bytes_per_page
        wire_layout = "page_first_direct" if dst_layout == DEVICE else dst_layout    # the receiver's staging
        pieces = {"layer_first", "page_first_direct"}
        converts = src_layout == DEVICE or not (src_layout == wire_layout or {src_layout, wire_layout} <= pieces)
        assert peer.event("ready")["converts"] == converts
        assert np.array_equal(read_kv(pool, dst_pages), expected(7, len(src_pages)))
        peer.finish()
    finally:
        peer.close()
        receiver.close()
        pool.close()


def test_the_decode_cache_serves_the_received_prefix(rt):
    """The decode side's KVCache takes the pages (``receive_prefix``): a later request matches the whole prompt on
    the device tier and reads the prefill side's bytes. A second prompt extending the first is asked for only past
    what the cache holds already (``skip``)."""
    cache, _, device, host = build(rt, device_pages=32, host_pages=32, geometry=GEOMETRY)
    receiver = KVReceiver(device, dtype="bfloat16")
    rng = np.random.default_rng()
    tokens = rng.integers(0, 128000, 12 * GEOMETRY.page_size)
    peer = Peer("prefill", address=receiver.address, runtime=rt.name, layout="page_first", pages=24,
                requests=[request_spec("first", range(0, 6), 3), request_spec("whole", range(10, 22), 5)])
    try:
        link = receiver.accept(60)
        assert receive_prefix(cache, link, "first", tokens[:6 * GEOMETRY.page_size], timeout=60) == 6
        assert receive_prefix(cache, link, "whole", tokens, timeout=60) == 6        # pages 6..11 of "whole"
        peer.finish()
        with cache.request(tokens, prefetch=False) as served:
            served.wait()
            pages = served.prefix_pages
            assert len(pages) == 12 and served.match.device_pages.size == 12
            got = read_kv(device, pages)
        assert np.array_equal(got[:6], expected(3, 6))
        assert np.array_equal(got[6:], expected(5, 12)[6:])
    finally:
        peer.close()
        receiver.close()
        cache.close()
        device.close()
        host.close()


def test_two_requests_in_flight_at_once_from_two_threads(rt):
    pool = make_pool(GEOMETRY, "layer_first", 64, rt)
    receiver = KVReceiver(pool, dtype="bfloat16")
    peer = Peer("prefill", address=receiver.address, runtime=rt.name, layout="page_first", pages=64, threads=True,
                batch_entries=4, staging_pages=5,
                requests=[request_spec("a", range(0, 20), 11), request_spec("b", range(20, 40), 12)])
    try:
        link = receiver.accept(60)
        results: dict[str, object] = {}

        def expect(rid: str, pages) -> None:
            results[rid] = link.expect(rid, pages).wait(60)

        threads = [threading.Thread(target=expect, args=("a", range(40, 60))),
                   threading.Thread(target=expect, args=("b", range(0, 20)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(results) == {"a", "b"}
        assert np.array_equal(read_kv(pool, range(40, 60)), expected(11, 20))
        assert np.array_equal(read_kv(pool, range(0, 20)), expected(12, 20))
        peer.finish()
    finally:
        peer.close()
        receiver.close()
        pool.close()


@pytest.mark.gpu
def test_a_request_lands_between_gpu_pools_of_two_processes(cuda):
    """On a GPU: device pool to device pool, each process with its own CUDA context; with the non-CUDA wheel both
    sides stage through registered host memory (kvtier's transfer engine copies device ↔ host)."""
    pool = make_pool(GEOMETRY, DEVICE, 32, cuda)
    receiver = KVReceiver(pool, dtype="bfloat16")
    src_pages, dst_pages = list(range(2, 20)), [31, *range(4, 21)]
    peer = Peer("prefill", address=receiver.address, runtime="cuda", layout=DEVICE, pages=24,
                requests=[request_spec("gpu", src_pages, 9)])
    try:
        landing = receiver.accept(60).expect("gpu", dst_pages)
        assert landing.wait(60).tolist() == dst_pages
        assert np.array_equal(read_kv(pool, dst_pages), expected(9, len(src_pages)))
        peer.finish()
    finally:
        peer.close()
        receiver.close()
        pool.close()
