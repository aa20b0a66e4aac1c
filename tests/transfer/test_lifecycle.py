"""Pools, engines and captured graphs have a lifecycle: closing waits for the transfers that use the memory, and every
use after close raises at the call, before anything is queued or allocated. A device fault is sticky: every later
transfer on the device raises. The events a Transfer hands out are the Transfer's: closing them breaks nothing."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from helpers.device_kernels import TOUCH
from helpers.pools import engine_on, fill_device, fill_host, host_bytes, host_page, poison_device, read_device
from helpers.runtimes import EMULATED_MODES

from kvtier.errors import BufferClosed, BufferInUse, IllegalAddress, KvtierError
from kvtier.memory import CpuAddress, DeviceBuffer, HostBuffer
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import BACKENDS, TransferEngine

G = KVGeometry.mha(2, kv_heads=2, head_dim=32, itemsize=2, page_size=16)


def test_an_engine_over_a_closed_pool_is_refused(runtime):
    dev = DevicePool.allocate(G, 4, 0, runtime=runtime)
    host = HostPool.allocate(G, "page_first", pages=4, runtime=runtime)
    dev.close()
    with pytest.raises(BufferClosed):
        TransferEngine(dev, host)
    host.close()
    with pytest.raises(BufferClosed):
        TransferEngine(DevicePool.allocate(G, 4, 0, runtime=runtime), host)


@pytest.mark.parametrize("which", ["device", "host"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_an_engine_refuses_work_once_a_pool_is_closed(runtime, backend, which):
    """Unified aliases once let the kernel backend write into a buffer that reused the closed pool's address."""
    with engine_on(runtime, G, "layer_first", backend=backend) as (dev, host, engine):
        engine.backup([0], [1]).wait()
        (dev if which == "device" else host).close()
        allocations = len(runtime._device_allocs) if hasattr(runtime, "_device_allocs") else None
        for call in (lambda: engine.backup([0], [1]), lambda: engine.load([1], [0])):
            with pytest.raises(BufferClosed, match="closed"):
                call()
        if allocations is not None:
            assert len(runtime._device_allocs) == allocations


def _lazy() -> EmulatedRuntime:
    """Queued work runs only when waited for: a transfer is certainly still in flight when close() is called."""
    return EmulatedRuntime("split", schedule="lazy")


@pytest.mark.parametrize("direction", ["backup", "load"])
@pytest.mark.parametrize("which", ["device", "host"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_closing_a_pool_waits_for_transfers_in_flight(backend, which, direction):
    """It used to crash the process (SIGSEGV: direct, batch, staged) or lose the transfer (kernel)."""
    runtime = _lazy()
    with engine_on(runtime, G, "page_first_direct", device_pages=6, host_pages=6, backend=backend,
                   staging_bytes=2 * G.bytes_per_page) as (dev, host, engine):
        data, snapshot = fill_device(dev), fill_host(host)
        backup = direction == "backup"
        transfer = engine.backup([5, 0, 3], [1, 2, 4]) if backup else engine.load([1, 2, 4], [5, 0, 3])
        pending = sum(len(s.pending) for s in runtime.scheduler.streams(0))
        assert pending, "the lazy schedule should leave the transfer queued"
        kept = read_device(dev, 0, 1) if which == "host" else host_bytes(host)
        (dev if which == "device" else host).close()
        assert transfer.done()
        if direction == "backup" and which == "device":
            after = host_bytes(host)
            for page, slot in ((5, 1), (0, 2), (3, 4)):
                start = slot * host.strides.page + host.strides.layer
                np.testing.assert_array_equal(after[start:start + G.page_bytes], data[(0, 1)][page])
        if direction == "load" and which == "host":
            for page, slot in ((5, 1), (0, 2), (3, 4)):
                start = slot * host.strides.page + host.strides.layer
                got = read_device(dev, 0, 1)[page]
                np.testing.assert_array_equal(got, snapshot[start:start + G.page_bytes])
        assert kept is not None


def test_use_after_engine_close_raises_and_allocates_nothing(runtime):
    with engine_on(runtime, G, "page_first", engine=False) as (dev, host, _):
        engine = TransferEngine(dev, host)
        engine.close()
        engine.close()
        allocations = len(runtime._device_allocs) if hasattr(runtime, "_device_allocs") else None
        ranges = len(runtime._host)
        for call in (lambda: engine.backup([0], [1]), lambda: engine.load([1], [0]),
                     lambda: engine.capture_load([1], [0], layer=0)):
            with pytest.raises(BufferClosed, match="TransferEngine is closed"):
                call()
        assert len(runtime._host) == ranges
        if allocations is not None:
            assert len(runtime._device_allocs) == allocations
        engine.synchronize()


def test_captured_load_after_engine_close_refuses_to_replay(runtime):
    with engine_on(runtime, G, "page_first_direct", engine=False) as (dev, host, _):
        engine = TransferEngine(dev, host)
        captured = engine.capture_load([1, 2], [0, 3], layer=1)
        captured.replay()
        captured.close()
        captured.close()
        with pytest.raises(BufferClosed):
            captured.replay()
        second = engine.capture_load([2], [1], layer=0)
        engine.close()
        with pytest.raises(BufferClosed):
            second.replay()


def test_replay_then_close_drains_first(runtime):
    """close() right after replay() used to free the ring before the stream drained (IllegalAddress)."""
    with engine_on(runtime, G, "page_first_direct") as (dev, host, engine):
        snapshot = fill_host(host)
        poison_device(dev)
        captured = engine.capture_load([3], [2], layer=1)
        captured.replay()
        captured.close()
        start = 3 * host.strides.page + host.strides.layer
        np.testing.assert_array_equal(read_device(dev, 0, 1)[2], snapshot[start:start + G.page_bytes])


def test_device_pool_close_is_idempotent_and_releases_owned_memory(runtime):
    dev = DevicePool.allocate(G, 4, 0, runtime=runtime)
    addresses = dev.layer_device_addresses(0)
    dev.close()
    dev.close()
    assert dev.closed
    with pytest.raises(BufferClosed):
        dev.layer_device_addresses(0)
    with DeviceBuffer(G.page_bytes * 4, 0, runtime=runtime) as other:
        assert other.address.device == addresses[0].device


def test_buffer_in_use_never_hides_the_body_exception(runtime):
    with pytest.raises(ZeroDivisionError):
        with HostBuffer.allocate(4096, runtime=runtime) as buf:
            view = buf.as_tensor()
            raise ZeroDivisionError("the body's own error")
    del view
    buf.close()
    assert buf.closed
    with pytest.raises(BufferInUse), HostBuffer.allocate(4096, runtime=runtime) as other:
        kept = other.as_tensor()
    del kept
    other.close()


def test_errors_are_kvtier_errors(runtime):
    with engine_on(runtime, G, "page_first") as (dev, host, engine):
        with pytest.raises(KvtierError):
            engine.backup([0, 1], [1])


@pytest.mark.gpu
def test_device_pool_keeps_engine_tensors_alive(cuda):
    """from_tensors used to keep only addresses: dropped tensors went back to torch's caching allocator, whose next
    tensors got the same memory while kvtier still wrote there."""
    import torch

    pages = 8
    tensors = [[torch.ones(pages * G.page_size, G.row_bytes // 2, dtype=torch.bfloat16, device="cuda:0")
                for _ in range(G.layers)] for _ in range(G.tensors)]
    pool = DevicePool.from_tensors(G, tensors, runtime=cuda)
    addresses = {a.value for t in range(G.tensors) for a in pool.layer_device_addresses(t)}
    del tensors
    gc.collect()
    newcomers = [torch.empty(pages * G.page_size, G.row_bytes // 2, dtype=torch.bfloat16, device="cuda:0")
                 for _ in range(2 * G.tensors * G.layers)]
    assert not addresses & {t.data_ptr() for t in newcomers}
    pool.close()


def test_closing_a_device_buffer_under_a_pool_closes_the_pool_for_engines(runtime):
    """Buffers handed to a pool by their owner may be closed behind its back: the engine waits, then refuses."""
    buffers = [[DeviceBuffer(4 * G.page_bytes, 0, runtime=runtime) for _ in range(G.layers)] for _ in range(G.tensors)]
    dev = DevicePool(G, 4, 0, runtime, buffers)
    with engine_on(runtime, G, "page_first", engine=False) as (_, host, _unused):
        engine = TransferEngine(dev, host)
        pending = engine.backup([0, 1], [2, 3])
        buffers[1][0].close()
        assert pending.done()
        with pytest.raises(BufferClosed):
            engine.load([2], [1])
        engine.close()
    for row in buffers:
        for buffer in row:
            buffer.close()


def test_a_fault_poisons_later_transfers_on_the_device():
    runtime = EmulatedRuntime("split", schedule="lazy")
    dev = DevicePool.allocate(G, 4, 0, runtime=runtime)
    host = HostPool.allocate(G, "page_first", pages=4, runtime=runtime)
    engine = TransferEngine(dev, host, backend="kernel")
    from kvtier.memory import DeviceAddress
    from kvtier.runtime import i64
    runtime.launch(runtime.load_program(TOUCH, 0), "touch", grid=1, block=32, stream=engine.streams["h2d"],
                   args=[DeviceAddress(host.buffer.cpu_address.value, 0), i64(16)])
    behind = engine.load([0], [1])
    with pytest.raises(IllegalAddress, match="not mapped"):
        behind.wait()
    for call in (behind.done, behind.wait, lambda: engine.backup([0], [1])):
        with pytest.raises(IllegalAddress, match="poisoned"):
            call()
    with pytest.raises(IllegalAddress):
        engine.close()
    host.close(), dev.close()


def test_closing_a_captured_shape_waits_for_a_load_another_thread_is_queuing():
    """``CapturedShape.close()`` (and ``CapturedLoad.close()``) did not take the engine's lock, so a close from one
    thread while another thread was inside ``shape.load`` (past its ``closed`` check, holding the engine lock) freed
    the graph's index buffer, its stream and the pinned staging under that load: the load then copied into freed
    device memory (a raw ``RuntimeCallError: cudaMemcpyAsync ... not mapped``; on a GPU a write to freed memory)
    instead of landing or raising BufferClosed. The engine is documented as safe to call from several threads and
    ``close`` "waits for replays in flight": the close waits for the load being queued, and the load lands.
    The loader is parked in ``runtime.memcpy_async`` to make the interleaving deterministic.
    (Found adversarially, issue #13.)"""
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
                    np.testing.assert_array_equal(got[page], host_page(host, snapshot, tensor, layer, slot))


@pytest.mark.parametrize("mode", EMULATED_MODES)
def test_closing_a_transfers_events_leaves_them_working(mode):
    """Found: once the caller closed a transfer's ``finished`` (or a layer) event, ``wait()`` raised but
    ``stream_wait()`` silently ordered nothing. Decided: the events a Transfer hands out belong to it (kvtier may still
    wait on them, as the cache's load-backs do), so ``close()`` on them does nothing and every use keeps working; a
    consumer ordered through ``stream_wait`` after the close still reads the loaded bytes. (Issue #13.)"""
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
