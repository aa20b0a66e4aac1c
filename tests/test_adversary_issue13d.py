"""Adversary 4 (issue 13): backup_threads and closed / recycled events. Each test here fails because of a defect;
its docstring says what is wrong and what should happen."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers.cache import build, close_all, serve
from helpers.pools import engine_on, fill_device, fill_host

from kvtier.address import CpuAddress
from kvtier.errors import InvalidArgument
from kvtier.pools import KVGeometry
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer.family import FamilyEngine

G = KVGeometry.mha(3, kv_heads=2, head_dim=32, itemsize=2, page_size=4)
MODES = ["split", "unified"]


# -- closed events are still accepted by Stream.wait (and so by every ``after=`` and ``stream_wait``) ---
@pytest.mark.parametrize("mode", MODES)
def test_a_stream_refuses_to_wait_on_a_closed_event(mode):
    """``Stream.wait(event)`` with a closed event silently does nothing on the emulator (``close`` drops the marker,
    and ``EmulatedStream.wait`` skips events without one), while record/query/synchronize/elapsed_ms of the same event
    raise InvalidArgument "closed". A wait that is dropped without a word loses an ordering the caller asked for; on
    CUDA the closed handle may already belong to another event (see the CUDA test below). It should raise
    InvalidArgument "closed" like every other use."""
    runtime = EmulatedRuntime(mode, seed=0)
    producer, consumer = runtime.create_stream(0), runtime.create_stream(0)
    event = runtime.create_event(0)
    event.record(producer)
    event.close()
    with pytest.raises(InvalidArgument, match="closed"):
        consumer.wait(event)


@pytest.mark.parametrize("mode", MODES)
def test_closing_a_transfers_events_leaves_them_working(mode):
    """Found: once the caller closed a transfer's ``finished`` (or a layer) event, ``wait()`` raised but
    ``stream_wait()`` silently ordered nothing. Decided: the events a Transfer hands out belong to it (kvtier may still
    wait on them, as the cache's load-backs do), so ``close()`` on them does nothing and every use keeps working; a
    consumer ordered through ``stream_wait`` after the close still reads the loaded bytes."""
    runtime = EmulatedRuntime(mode, seed=0)
    with engine_on(runtime, G, "page_first") as (dev, host, engine):
        fill_device(dev)
        host_bytes = fill_host(host)
        transfer = engine.load([0, 1], [2, 3])
        transfer.finished.close()
        transfer.layer_events[1].close()
        consumer = runtime.create_stream(0)
        transfer.stream_wait(consumer)
        transfer.stream_wait(consumer, layer=1)
        out = np.empty(dev.layer_bytes, np.uint8)
        runtime.memcpy_async(CpuAddress(out.ctypes.data), dev.layer_device_addresses(0)[1], out.nbytes,
                             stream=consumer)
        consumer.synchronize()
        transfer.wait()
        transfer.wait_layer(1)
        assert transfer.done()
        slot = host.strides
        for page, source in ((2, 0), (3, 1)):
            rows = [host_bytes[source * slot.page + token * slot.slot + 1 * slot.layer:][:G.row_bytes]
                    for token in range(G.page_size)]
            assert np.array_equal(out.reshape(dev.pages, -1)[page], np.concatenate(rows))
        consumer.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_transfer_ordered_after_a_closed_event_is_refused(mode):
    """``engine.load(..., after=event)`` (and backup, and ``after=[transfer]``) with a closed event queues the load
    with no ordering at all (``order_after`` → ``Stream.wait`` skips it), although the caller asked for one. It should
    raise InvalidArgument "closed" and queue nothing."""
    runtime = EmulatedRuntime(mode, seed=0)
    with engine_on(runtime, G, "page_first") as (dev, host, engine):
        fill_device(dev)
        fill_host(host)
        writer = runtime.create_stream(0)
        written = runtime.create_event(0)
        written.record(writer)
        written.close()
        with pytest.raises(InvalidArgument, match="closed"):
            engine.load([0, 1], [2, 3], after=written)
        engine.synchronize()


def test_cuda_stream_wait_refuses_a_closed_event_whose_handle_was_recycled():
    """CUDA (through a stand-in cudart, no GPU needed): ``CudaStream.wait`` passes ``event.native`` to
    cudaStreamWaitEvent without the closed check that record/query/synchronize/elapsed_ms go through
    (``CudaEvent._handle``). Since closed handles now go to the runtime's spare list and are handed out again by
    ``create_event``, waiting on a closed event makes the stream wait on whatever the handle's new owner records. The
    wait should raise InvalidArgument "closed" and never reach cudaStreamWaitEvent."""
    bindings = pytest.importorskip("cuda.bindings.runtime")
    from kvtier.runtime.cuda import CudaEvent, CudaStream

    class Cudart:
        cudaError_t = bindings.cudaError_t
        cudaEventDisableTiming = 2

        def __init__(self):
            self.handles, self.waited = iter(range(100, 200)), []

        def cudaEventCreateWithFlags(self, flags):
            return self.cudaError_t.cudaSuccess, next(self.handles)

        def cudaEventDestroy(self, handle):
            return (self.cudaError_t.cudaSuccess,)

        def cudaStreamWaitEvent(self, stream, event, flags):
            self.waited.append(event)
            return (self.cudaError_t.cudaSuccess,)

    cudart, spare = Cudart(), []
    closed = CudaEvent(cudart, 0, spare=spare)
    closed.close()
    reused = CudaEvent(cudart, 0, spare=spare, handle=spare.pop())  # what create_event does with a spare handle
    assert reused.native == closed.native
    stream = CudaStream(cudart, 0, 7, owned=False)
    with pytest.raises(InvalidArgument, match="closed"):
        stream.wait(closed)
    assert cudart.waited == [], "the closed event's handle (now another event's) reached cudaStreamWaitEvent"


# -- the cache keeps (and later uses) events it only borrowed from, or handed to, the caller ---
@pytest.mark.parametrize("mode", MODES)
def test_closing_the_event_given_as_after_does_not_break_later_allocations(mode):
    """``cache.free(pages, after=event)`` keeps the caller's own event object as a fence (``after_events`` returns it
    as is) and queries it at later allocations. If the caller closes its event once the call has returned (CUDA lets a
    caller destroy an event right after cudaStreamWaitEvent), every later ``allocate`` raises InvalidArgument "this
    emulated event is closed" and the cache stays wedged (the fence is never dropped). The cache should not depend on
    the caller's event after the call: record its own marker (e.g. on a stream made to wait on the caller's event)."""
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


@pytest.mark.parametrize("mode", MODES)
def test_closing_a_load_backs_finished_event_does_not_fail_the_load(mode):
    """A LoadBack hands the caller its Transfer, and the cache's waiter thread later waits on that same
    ``transfer.finished``. A caller that closes the event it was handed (it waits per layer, say, and closes what it
    does not use) makes the waiter's ``op.wait()`` raise "closed", so the cache counts a load error and drops the
    loaded device pages from the tree and frees them while the caller still holds the locked match and reads those
    pages. Closing a handed-out event should not fail a load that landed: the cache should wait on an event of its
    own."""
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
        assert cache.stats().get("errors.load", 0) == 0, "a load that landed was counted as failed"
        assert len(cache.match_prefix(tokens).device_pages) == 4, "the loaded prefix was dropped from the device"
        assert cache.device.free_pages == 4, "pages the caller holds (locked) were freed"
        cache.unlock(match)
    finally:
        close_all(cache, dev, host)


# -- the emulated event races its own close ---
def test_an_event_closed_while_another_thread_queries_it_raises_a_kvtier_error():
    """``EmulatedEvent.query`` checks ``closed`` once and then reads ``self.marker`` again after making progress;
    ``close()`` (from another thread, without the scheduler lock) sets the marker to None in between, and the query
    dies with AttributeError "'NoneType' object has no attribute 'done'". The interleaving is forced here by closing
    from another thread inside the scheduler's progress step. A query racing a close should answer (from the marker
    it read) or raise InvalidArgument "closed", never an AttributeError."""
    runtime = EmulatedRuntime("split", seed=0)
    stream = runtime.create_stream(0)
    event = runtime.create_event(0)
    event.record(stream)
    progress = runtime.scheduler.progress

    def progress_while_closed_elsewhere(*args, **kwargs):
        closer = threading.Thread(target=event.close)
        closer.start()
        closer.join()
        return progress(*args, **kwargs)

    runtime.scheduler.progress = progress_while_closed_elsewhere
    try:
        event.query()
    except InvalidArgument:
        pass
    finally:
        runtime.scheduler.progress = progress
        stream.synchronize()


# -- backup_threads stops at TransferEngine ---
def test_family_engine_backups_use_narrow_blocks_like_transfer_engine():
    """The backup_threads policy (kernel backups at most 512 threads a block when the budget is more than one block:
    1024-thread blocks writing host memory slowed a concurrent GEMM by ~90% on the H200) applies to TransferEngine
    only. FamilyEngine, whose docstring promises "the same contract as TransferEngine" and which a hybrid KVCache
    builds for its state snapshots (StateTier, max_blocks=2), still backs up with 2 blocks of 1024 threads and has no
    ``backup_threads`` to set. It should take ``backup_threads`` with the same default."""
    runtime = EmulatedRuntime("split", seed=0)
    g = StateGeometry.mamba(2, (4, 3), (2, 2, 4), conv_dtype="float32", temporal_dtype="float32")
    dev = StateDevicePool.allocate(g, 3, 0, runtime=runtime)
    host = StateHostPool.allocate(g, slots=3, runtime=runtime)
    engine = FamilyEngine(dev, host, max_blocks=2)
    blocks = []
    launch = runtime.launch

    def recorded(program, name, **kwargs):
        blocks.append(kwargs["block"])
        return launch(program, name, **kwargs)

    runtime.launch = recorded
    try:
        engine.backup([0, 1], [1, 2]).wait()
        assert set(blocks) == {512}, f"state backups launched {sorted(set(blocks))}-thread blocks"
    finally:
        runtime.launch = launch
        engine.close()
        host.close()
        dev.close()
