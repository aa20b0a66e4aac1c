"""Pools, engines and captured graphs have a lifecycle: closing waits for the transfers that use the memory (also a
close from another thread, or from the queuing thread itself in the middle of a transfer), and every use after close
raises at the call, before anything is queued or allocated. A device fault is sticky: every later transfer on the
device raises. The events a Transfer hands out are the Transfer's: closing them breaks nothing."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from helpers.device_kernels import TOUCH
from helpers.operands import no_automatic_collection
from helpers.pools import (
    engine_on,
    fill_device,
    fill_host,
    host_bytes,
    host_page,
    poison_device,
    read_device,
    small_engine,
)
from helpers.runtimes import EMULATED_MODES

from kvtier.errors import BufferClosed, BufferInUse, IllegalAddress, KvtierError
from kvtier.memory import CpuAddress, DeviceBuffer, HostBuffer
from kvtier.pause_points import armed
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime import create
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


@pytest.mark.parametrize("backend", ["direct", "batch", "staged"])
@pytest.mark.parametrize("direction", ["backup", "load"])
@no_automatic_collection()
def test_an_engine_closed_from_its_own_queuing_thread_mid_transfer_is_not_used_after_close(backend, direction,
                                                                                            monkeypatch):
    """``engine.close()`` reached on the thread that is inside ``engine.backup``/``load`` (a SIGTERM handler doing a
    graceful shutdown, or a finalizer run by a collection inside the call: both run between bytecodes of the queuing
    thread), forced deterministically from the first ``memcpy_run_sets_async`` of the transfer. ``PoolUser`` guards
    both with one ``threading.RLock`` (transfer/job.py:238), so the close re-enters, drains, marks the engine closed
    and frees its streams and the staging area (job.py:286 ``_release``) under the transfer still queuing, which then
    carries on with them: the direct/batch backends queue on a destroyed stream (RuntimeCallError 'stream ... is
    destroyed'), the staged backend queues its DMA over the freed staging buffer (staged.py:174; refused here only
    because the emulator checks the address when queued: on CUDA a freed ``cudaMalloc`` block reused meanwhile is read
    or written), and where the close lands inside a relayout, the error is replaced by 'fence of a lease this ring did
    not hand out' from a ``finally`` (staged.py:124). kvtier's host buffers defer a close requested inside their own
    use; the engine did not. Fix: count the queuing calls in progress (under the lock) and let a close that
    finds one on its own thread mark the engine closing and return, the outermost call finishing the close once its
    work is queued (or raise BufferInUse); a transfer that is then refused raises BufferClosed before queuing
    anything. (found adversarially, issue #15)"""
    rt = create("emulated:split")
    g, dev, host_pool, engine = small_engine(rt, backend, "layer_first")
    try:
        data = fill_device(dev)
        host_before = fill_host(host_pool)
        if direction == "load":
            poison_device(dev)
        queue = rt.memcpy_run_sets_async
        calls = []

        def hooked(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                engine.close()      # what a signal handler or a finalizer on this thread does
            return queue(*args, **kwargs)

        monkeypatch.setattr(rt, "memcpy_run_sets_async", hooked)
        pages = np.arange(6)
        try:
            transfer = engine.backup(pages, pages) if direction == "backup" else engine.load(pages, pages)
            transfer.wait()
        except BufferClosed:
            monkeypatch.undo()
            rt.synchronize(0)
            if direction == "backup":
                assert np.array_equal(host_bytes(host_pool), host_before), "a refused backup wrote the host pool"
            else:
                assert all((read_device(dev, t, layer) == 0xEE).all() for t in range(g.tensors)
                           for layer in range(g.layers)), "a refused load wrote the device pool"
            return
        monkeypatch.undo()
        rt.synchronize(0)
        assert engine.closed    # accepted: then it must have landed whole, and the engine be closed after it
        after = host_bytes(host_pool)
        for t in range(g.tensors):
            for layer in range(g.layers):
                pool_pages = read_device(dev, t, layer)
                for p in pages:
                    at = t * host_pool.tensor_bytes + layer * host_pool.strides.layer + p * host_pool.strides.page
                    expected = data[(t, layer)][p] if direction == "backup" else host_before[at:at + g.page_bytes]
                    got = after[at:at + g.page_bytes] if direction == "backup" else pool_pages[p]
                    assert np.array_equal(got, expected), (t, layer, p)
    finally:
        monkeypatch.undo()
        engine.close(), host_pool.close(), dev.close()


@pytest.mark.parametrize("backend", ["direct", "batch", "staged"])
@no_automatic_collection()
def test_ok_an_engine_closed_from_another_thread_mid_transfer_closes_after_it_lands(backend, monkeypatch):
    """Thread A is held inside the first ``memcpy_run_sets_async`` of a per-layer load (an event in a hook); thread B
    calls ``engine.close()`` and is seen at a pause point entering it while A holds the engine's lock; A is then let
    go. The load lands whole, the close returns once it has, the engine is closed, and a later load raises
    BufferClosed."""
    rt = create("emulated:split:lazy")
    g, dev, host_pool, engine = small_engine(rt, backend, "page_first", register_chunk_bytes=12288)
    try:
        fill_device(dev)
        host_data = fill_host(host_pool)
        poison_device(dev)
        queue = rt.memcpy_run_sets_async
        inside, go, closing = threading.Event(), threading.Event(), threading.Event()

        def hooked(*args, **kwargs):
            if threading.current_thread() is loader and not inside.is_set():
                inside.set()
                assert go.wait(60)
            return queue(*args, **kwargs)

        monkeypatch.setattr(rt, "memcpy_run_sets_async", hooked)
        out: dict = {}

        def load():
            try:
                out["transfer"] = engine.load(np.arange(8), np.arange(8))
                out["transfer"].wait()
            except BaseException as error:  # noqa: BLE001 - reported below
                out["load"] = error

        def close():
            try:
                engine.close()
            except BaseException as error:  # noqa: BLE001 - reported below
                out["close"] = error

        loader = threading.Thread(target=load)
        closer = threading.Thread(target=close)
        with armed("engine.close", closing.set):
            loader.start()
            assert inside.wait(60)
            closer.start()
            assert closing.wait(60)
            go.set()
            loader.join(60)
            closer.join(60)
        assert not loader.is_alive() and not closer.is_alive()
        assert "load" not in out and "close" not in out, out
        assert engine.closed and out["transfer"].done()
        monkeypatch.undo()
        reference = HostPool.allocate(g, "page_first", pages=10, runtime=rt)
        reference.buffer.as_tensor().numpy()[:] = host_data
        fresh = DevicePool.allocate(g, 8, 0, runtime=rt)
        check = TransferEngine(fresh, reference, backend="kernel")
        check.load(np.arange(8), np.arange(8)).wait()
        for t in range(g.tensors):
            for layer in range(g.layers):
                assert np.array_equal(read_device(dev, t, layer), read_device(fresh, t, layer))
        check.close(), reference.close(), fresh.close()
        with pytest.raises(BufferClosed):
            engine.load([0], [0])
    finally:
        monkeypatch.undo()
        engine.close(), host_pool.close(), dev.close()


class _Engine(TransferEngine):
    drained = False

    def drain(self) -> None:
        super().drain()
        self.drained = True


@pytest.mark.parametrize("backend", ["kernel", "direct", "staged", "batch"])
def test_host_pool_close_refuses_or_waits_for_a_concurrent_backup(backend):
    """HostPool.close() drains its engines one by one, then unregisters and unmaps the buffer without holding them
    off: a backup another thread submits after its engine was drained passes the open check, is queued, and runs
    against unregistered memory (device fault; on a GPU a DMA into unmapped memory). The hook below is that other
    thread: a second user of the pool (a second engine, say) being drained when the submission arrives. (found
    adversarially)"""
    for _ in range(50):
        rt = create("emulated:split:1:lazy")
        dev = DevicePool.allocate(G, 6, 0, runtime=rt)
        host = HostPool.allocate(G, "page_first", pages=8, runtime=rt)
        engine = _Engine(dev, host, backend=backend)
        fill_device(dev)
        submitted = []

        class OtherUser:
            def __init__(self, engine: _Engine, submitted: list) -> None:
                self.engine, self.submitted = engine, submitted

            def drain(self) -> None:
                if self.engine.drained:  # our engine was drained already: this is the window
                    try:
                        self.submitted.append(self.engine.backup([0, 1], [2, 3]))
                    except BufferClosed:
                        self.submitted.append(None)

        other = OtherUser(engine, submitted)
        host.add_user(other)
        host.close()
        if not submitted:
            engine.close(), dev.close()
            continue
        try:
            engine.close()  # waits for the late backup: IllegalAddress (its host memory was unregistered)
            rt.synchronize(0)
        finally:
            dev.close()
        return
    pytest.skip("drain order never put the engine first")
