"""The cache and the caller's events: ``after=`` takes whatever an engine takes (an event, a stream, a Transfer), and
the cache depends on the caller's event only during the call (it records markers of its own), so a caller that closes
its event afterwards, or closes an event the cache handed it, breaks no later allocation or load."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cache import build, close_all, serve
from helpers.runtimes import EMULATED_MODES

from kvtier.cache import CacheSettings, KVCache, Namespace
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import TransferEngine


def test_kvcache_after_accepts_a_transfer_like_every_engine():
    """A ``Transfer`` is a valid ``after=`` ("a Transfer is a valid after=": ``order_after`` in kvtier/transfer/job.py,
    which says "Every engine orders through here"). ``KVCache`` takes ``after=`` on ``insert``/``free``/``backup``/
    ``load_back`` but converted it in its own ``KVCache._markers``, which knew events and streams only:
    ``cache.insert(tokens, pages, after=load)`` with ``load`` a Transfer raised ``WrongRuntime("emulated:split needs
    one of its own streams, got Transfer(...)")``. The cache orders after the Transfer's ``finished`` event, as the
    engines do. (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime("split", seed=0)
    g = KVGeometry.mha(layers=2, kv_heads=2, head_dim=16, itemsize=2, page_size=4)
    device = DevicePool.allocate(g, pages=16, device=0, runtime=runtime)
    host = HostPool.allocate(g, "page_first", pages=16, kind="pinned", runtime=runtime)
    other = HostPool.allocate(g, "page_first", pages=4, kind="pinned", runtime=runtime)
    other.buffer.as_tensor().numpy()[:] = np.random.default_rng(0).integers(1, 256, other.buffer.nbytes,
                                                                            dtype=np.uint8)
    engine = TransferEngine(device, other)
    cache = KVCache(device, host, Namespace("m", g, "bfloat16", tp_rank=0, tp_size=1),
                    CacheSettings(write_policy="write_through"))
    try:
        pages = cache.allocate(2)
        load = engine.load([0, 1], pages)          # the model's KV for these pages arrives by a transfer
        cache.insert(np.arange(8), pages, after=load)
        assert cache.match_prefix(np.arange(8)).device_tokens == 8
    finally:
        cache.close()
        engine.close()
        other.close()
        host.close()
        device.close()


@pytest.mark.parametrize("mode", EMULATED_MODES)
def test_closing_the_event_given_as_after_does_not_break_later_allocations(mode):
    """``cache.free(pages, after=event)`` kept the caller's own event object as a fence and queried it at later
    allocations. If the caller closed its event once the call had returned (CUDA lets a caller destroy an event right
    after cudaStreamWaitEvent), every later ``allocate`` raised InvalidArgument "this emulated event is closed" and
    the cache stayed wedged (the fence was never dropped). The cache does not depend on the caller's event after the
    call: it records its own marker. (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime(mode, seed=0)
    cache, model, dev, host = build(runtime, device_pages=4, host_pages=8)
    try:
        stream = runtime.create_stream(0)
        event = runtime.create_event(0)
        event.record(stream)
        cache.free(cache.allocate(4), after=event)
        event.close()  # the caller's event, the caller's to close
        assert len(cache.allocate(2)) == 2
    finally:
        close_all(cache, dev, host)


@pytest.mark.parametrize("mode", EMULATED_MODES)
def test_closing_a_load_backs_finished_event_does_not_fail_the_load(mode):
    """A LoadBack hands the caller its Transfer, and the cache's waiter thread later waits on that same
    ``transfer.finished``. A caller that closed the event it was handed (it waits per layer, say, and closes what it
    does not use) made the waiter's ``op.wait()`` raise "closed", so the cache counted a load error, dropped the
    loaded device pages from the tree and freed them while the caller still held the locked match and read those
    pages. Closing a handed-out event does not fail a load that landed. (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime(mode, seed=0)
    cache, model, dev, host = build(runtime, device_pages=8, host_pages=16)
    tokens = np.arange(16)
    try:
        serve(cache, model, tokens)
        cache.drain()
        cache.evict(device_pages=8)
        match = cache.match_prefix(tokens, lock=True)
        load = cache.load_back(match, force=True)
        assert load is not None
        load.transfer.finished.close()
        for layer in range(cache.geometry.layers):
            load.wait_layer(layer)
        cache.drain()
        assert not model.mismatches(tokens, load.prefix_pages)
        assert cache.stats()["errors.load"] == 0, "a load that landed was counted as failed"
        assert len(cache.match_prefix(tokens).device_pages) == 4, "the loaded prefix was dropped from the device"
        assert cache.device.free_pages == 4, "pages the caller holds (locked) were freed"
        cache.unlock(match)
    finally:
        close_all(cache, dev, host)
