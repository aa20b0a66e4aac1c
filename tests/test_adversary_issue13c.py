"""Adversarial tests (issue 13c): TransferEngine.capture_shape and the hybrid cache's snapshot pinning.

Each test shows one defect: fresh random host bytes, poisoned destinations, every byte checked."""

from __future__ import annotations

import threading

import numpy as np
from helpers.cache import P, prompt
from helpers.hybrid import Hybrid
from helpers.pools import engine_on, fill_host, poison_device, read_device

from kvtier.cache import OutOfPages
from kvtier.pools import KVGeometry
from kvtier.runtime import create
from kvtier.runtime.emulated import EmulatedRuntime

G = KVGeometry.mha(2, kv_heads=2, head_dim=32, itemsize=2, page_size=4)


def _expected_page(host, snapshot, tensor, layer, slot):
    """A layer_first host page's bytes for (tensor, layer, slot), read from the CPU snapshot."""
    s = host.strides
    start = host.tensor_offset(tensor) + slot * s.page + layer * s.layer
    return np.concatenate([snapshot[start + t * s.slot:start + t * s.slot + G.row_bytes] for t in range(G.page_size)])


def test_a_captured_shape_loads_from_strided_int64_page_arrays():
    """What is wrong: ``shape.load(host_pages, device_pages)`` with int64 numpy page arrays that are views with a
    stride (``a[::2]``, ``a[::-1]``, a column of a 2-D array) raises a bare numpy ValueError ("To change to a dtype of
    a different size, the last axis must be contiguous") on hosts whose unit is the page (``layer_first``,
    ``page_first_direct``); plain ``engine.load``/``engine.backup`` on the kernel backend fail the same way, while the
    staged/direct/batch backends and the token-unit layouts accept them.
    Expected: any flat integer sequence is accepted (``index_array`` says so), the load moves the right bytes.
    Suspected: ``index_array`` / ``ChunkPlan.units`` / ``index_values`` keep the caller's strided view
    (``astype(copy=False)``); ``CapturedShape.load`` (and ``IndexRing.upload``) then call ``.view(np.uint8)`` on it
    without ``np.ascontiguousarray``."""
    runtime = EmulatedRuntime("split", seed=3)
    with engine_on(runtime, G, "layer_first", device_pages=8, host_pages=10) as (dev, host, engine):
        shape = engine.capture_shape(3)
        snapshot = fill_host(host)
        poison_device(dev)
        slots = np.arange(10, dtype=np.int64)[::3][:3]        # 0, 3, 6: a strided view
        pages = np.arange(8, dtype=np.int64)[::-2][:3]        # 7, 5, 3: a negative stride
        shape.load(slots, pages).wait()
        for tensor in range(G.tensors):
            for layer in range(G.layers):
                got = read_device(dev, tensor, layer)
                for slot, page in zip(slots.tolist(), pages.tolist(), strict=True):
                    np.testing.assert_array_equal(got[page], _expected_page(host, snapshot, tensor, layer, slot))
                assert (got[np.setdiff1d(np.arange(8), pages)] == 0xEE).all()


def test_closing_a_captured_shape_waits_for_a_load_another_thread_is_queuing():
    """What is wrong: ``CapturedShape.close()`` (and ``CapturedLoad.close()``) does not take the engine's lock, so a
    close from one thread while another thread is inside ``shape.load`` (past its ``closed`` check, holding the engine
    lock) frees the graph's index buffer, its stream and the pinned staging under that load: the load then copies
    into freed device memory (here a raw ``RuntimeCallError: cudaMemcpyAsync ... not mapped``; on a GPU a write to
    freed memory) instead of landing or raising BufferClosed.
    Expected (the engine is documented as safe to call from several threads; ``close`` "waits for replays in
    flight"): the close waits for the load being queued, and the load lands.
    Suspected: kvtier/transfer/engine.py ``CapturedLoad.close`` / ``CapturedShape.close`` (no ``engine._lock``).
    The loader is parked in ``runtime.memcpy_async`` to make the interleaving deterministic."""
    runtime = EmulatedRuntime("split", seed=1)
    with engine_on(runtime, G, "layer_first", device_pages=8, host_pages=8) as (dev, host, engine):
        shape = engine.capture_shape(2)
        snapshot = fill_host(host)
        poison_device(dev)
        entered, release = threading.Event(), threading.Event()
        original = runtime.memcpy_async

        def parked(*args, **kwargs):
            if threading.current_thread().name == "loader" and not entered.is_set():
                entered.set()
                release.wait(60)
            return original(*args, **kwargs)

        runtime.memcpy_async = parked
        outcome: dict[str, object] = {}

        def loader():
            try:
                shape.load([1, 2], [3, 4], after=None).wait()
                outcome["ok"] = True
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome["error"] = exc

        thread = threading.Thread(target=loader, name="loader")
        thread.start()
        try:
            assert entered.wait(60)
            closer = threading.Thread(target=shape.close)
            closer.start()
            closer.join(0.5)
            returned_early = not closer.is_alive()
        finally:
            release.set()
            thread.join(60)
            runtime.memcpy_async = original
        closer.join(60)
        assert "error" not in outcome, f"the load failed under a concurrent close: {outcome['error']!r}"
        assert not returned_early, "close returned while a load was still being queued"
        for tensor in range(G.tensors):
            for layer in range(G.layers):
                got = read_device(dev, tensor, layer)
                for slot, page in ((1, 3), (2, 4)):
                    np.testing.assert_array_equal(got[page], _expected_page(host, snapshot, tensor, layer, slot))


def test_a_second_shape_load_does_not_block_the_cpu_on_the_first_loads_after():
    """What is wrong: the second ``shape.load`` blocks the calling thread — while holding the engine lock, so every
    other thread's ``load``/``backup`` (the cache's backup thread) waits too — until everything the *first* load was
    ordered after has run: ``self._uploaded.synchronize()`` waits for the first load's index copy, which sits behind
    the first load's ``after`` (typically the model's stream, i.e. a whole forward pass). Here the second load has
    ``after=None`` and still does not return until the model stream's long kernel is done. Plain ``engine.load``
    queued the same way returns at once (README: no load() synchronizes).
    Expected: shape loads queue without a CPU wait on earlier loads' dependencies (e.g. a ring of staging areas, or
    waiting only for the staging copy's own completion without putting it behind ``after``), like plain loads.
    Suspected: kvtier/transfer/engine.py ``CapturedShape.load`` (one staging area, reused after
    ``_uploaded.synchronize()``, and the upload queued after ``order_after(..., after)``)."""
    runtime = EmulatedRuntime("split", seed=1)
    with engine_on(runtime, G, "layer_first", device_pages=8, host_pages=8) as (dev, host, engine):
        shape = engine.capture_shape(2)
        fill_host(host)
        model = runtime.create_stream(0)
        runtime.busy(model, 100_000)
        model_done = runtime.create_event(0)
        model_done.record(model)
        engine.load([1, 2], [3, 4], after=model)
        engine.load([5, 6], [1, 2], after=None)
        assert not model_done.query(), "precondition: plain loads queue without waiting"
        shape.load([1, 2], [3, 4], after=model)
        assert not model_done.query()
        shape.load([5, 6], [1, 2], after=None)
        assert not model_done.query(), "the second shape load waited on the CPU for the model's stream"
        engine.synchronize()


def test_a_waited_load_back_does_not_keep_its_device_state_slot_pinned():
    """What is wrong: after ``load_back`` of a host-only snapshot, ``load.wait()`` and ``unlock(match)``, the only
    device state slot still cannot be had: ``allocate_state()`` raises OutOfPages ("the rest by snapshots that are
    locked or in flight") because the node stays ``loading`` until the controller's load waiter thread gets the cache
    lock to complete the operation, and ``allocate_device_states`` waits for backups in flight (``finish_now``) but
    never for load-backs. The same happens with the next request's ``load_back`` (declined ``no_device_state``) and,
    for KV pages, with ``allocate()`` after a waited load-back.
    Expected: a snapshot whose load has finished (the caller waited for it) and which no lock pins is evictable
    (README: completions are handled the moment they complete); at worst the allocation finishes loads in flight
    as it does backups.
    Suspected: kvtier/cache/tiers.py ``Tiers.allocate_device_states`` / ``allocate_device`` with
    ``inflight=lambda: controller.inflight(BACKUP)`` in kvtier/cache/cache.py (load-backs are never finished there)."""
    hybrid = Hybrid(create("emulated:split"), device_states=1, host_states=4)
    cache = hybrid.cache
    try:
        failures = 0
        for _ in range(20):
            tokens = prompt(2 * P)
            hybrid.serve(tokens)
            cache.backup(cache.match_prefix(tokens))
            cache.drain()
            cache.evict_states(device=1)
            hybrid.model.poison_states()
            match = cache.match_prefix(tokens, lock=True)
            assert match.device_state is None and match.host_state is not None
            load = cache.load_back(match, force=True)
            assert load is not None
            load.wait()
            assert hybrid.model.state_ok(tokens, load.device_state)
            cache.unlock(match)
            try:
                slot = cache.allocate_state()
            except OutOfPages:
                failures += 1
            else:
                cache.free_state(slot)
            cache.drain()
            cache.evict(device_pages=16, host_pages=32)
        cache.check()
        assert failures == 0, f"allocate_state() found no slot in {failures} of 20 rounds after a waited load-back"
    finally:
        hybrid.close()
