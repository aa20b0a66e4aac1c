"""Emulator semantics other tests lean on: the two schedules, sticky faults (on the faulting device only, and what
their messages blame), copy checks at call and at run time, frees that wait like cudaFree, device memory limits,
accesses running across mappings, event timing that is not ready before the events complete."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from helpers.device_kernels import TOUCH, XOR, random_bytes
from helpers.operands import MODES, POISON, dev_idx, device

from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import IllegalAddress, KvtierError, RuntimeCallError, WrongDeviceError
from kvtier.memory import CpuAddress, DeviceAddress, DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import create, i64
from kvtier.runtime.emulated import EmulatedRuntime


def test_lazy_work_lands_only_when_synchronized():
    lazy = EmulatedRuntime("split", schedule="lazy")
    n = 4096
    data = random_bytes(n)
    with HostBuffer.allocate(2 * n, HostKind.PINNED, runtime=lazy) as host, DeviceBuffer(n, 0, runtime=lazy) as dev:
        view = host.as_tensor().numpy()
        view[:n], view[n:] = data, 0x11
        stream = lazy.create_stream(0)
        lazy.memcpy_async(dev.address, host.cpu_address, n, stream=stream)
        lazy.memcpy_async(host.cpu_address + n, dev.address, n, stream=stream)
        assert (view[n:] == 0x11).all(), "work ran before anyone waited for it"
        lazy.synchronize(0)
        np.testing.assert_array_equal(view[n:], data)
        del view


def test_eager_streams_run_ahead_in_random_order_but_respect_waits():
    """Two streams, a copy each, the second queued later: some seed runs it first; with a wait, none does."""
    n = 4096
    orders = set()
    for seed in range(16):
        for ordered in (False, True):
            rt = EmulatedRuntime("split", seed=seed)
            with HostBuffer.allocate(3 * n, HostKind.PINNED, runtime=rt) as host, \
                    DeviceBuffer(n, 0, runtime=rt) as dev:
                view = host.as_tensor().numpy()
                view[:n], view[n:2 * n], view[2 * n:] = 0x01, 0x02, 0x00
                first, second = rt.create_stream(0), rt.create_stream(0)
                rt.memcpy_async(dev.address, host.cpu_address, n, stream=first)
                if ordered:
                    done = rt.create_event(0)
                    done.record(first)
                    second.wait(done)
                    rt.memcpy_async(dev.address, host.cpu_address + n, n, stream=second)
                else:
                    rt.memcpy_async(dev.address, host.cpu_address + n, n, stream=second)
                rt.synchronize(0)
                winner = dev.download()[0]
                if ordered:
                    assert winner == 0x02, f"seed {seed}: a stream ran past its wait"
                else:
                    orders.add(winner)
                del view
    assert orders == {0x01, 0x02}, "the eager schedule never reordered two independent streams"


def test_fault_is_sticky_like_a_lost_cuda_context(split):
    """An illegal address poisons the device: the wait that sees it raises, and so does everything after."""
    with HostBuffer.allocate(4096, runtime=split) as buf, DeviceBuffer(4096, 0, runtime=split) as dev:
        stream = split.create_stream(0)
        program = split.load_program(TOUCH, 0)
        split.launch(program, "touch", grid=1, block=32, stream=stream,
                     args=[DeviceAddress(buf.cpu_address.value, 0), i64(16)])
        after = split.create_event(0)
        split.memcpy_async(dev.address, buf.cpu_address, 4096, stream=stream)
        after.record(stream)
        with pytest.raises(IllegalAddress, match="not mapped"):
            stream.synchronize()
        for call in (after.query, after.synchronize, stream.synchronize, lambda: split.synchronize(0),
                     lambda: split.memcpy(dev.address, buf.cpu_address, 16), lambda: split.create_stream(0),
                     lambda: split.launch(program, "touch", grid=1, block=32, stream=stream,
                                          args=[dev.address, i64(16)])):
            with pytest.raises(IllegalAddress, match="poisoned"):
                call()
    other = split.create_stream(1)
    split.legacy_stream(1).synchronize()
    other.synchronize()



def test_a_wait_value_on_an_unmapped_address_poisons_its_own_device_only():
    """``EmulatedRuntime._wait_value`` promises: "The counter is read through the device's map when the scheduler
    considers the wait, so an address the device cannot see faults then, as a GPU's would", and the scheduler
    promises that a fault poisons *that* device (its queued work dropped, the next call that observes it raises the
    fault, later calls raise "unusable"). The read used to happen while picking the next runnable op, outside the
    scheduler's fault handling: the IllegalAddress escaped from whatever call happened to schedule work, device 0 was
    never marked faulted, and its wait stayed queued forever, so every enqueue / synchronize on healthy device 1
    raised device 0's IllegalAddress. Device 1 keeps working; device 0 reports the fault once, then "unusable".
    (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime("split", devices=2, seed=0)
    waiter, healthy = runtime.create_stream(0), runtime.create_stream(1)
    counter = DeviceBuffer(64, 0, runtime=runtime)
    try:
        # passes every check of Runtime.wait_value (device 0 address, 8-byte aligned) but maps nothing on device 0
        runtime.wait_value(waiter, counter.address + (64 << 20), 1)
        errors = []
        for _ in range(3):
            try:
                runtime.busy(healthy, 1)
                healthy.synchronize()
            except KvtierError as error:   # device 1 did nothing wrong
                errors.append(error)
        assert not errors, f"work on healthy device 1 raised device 0's fault: {errors[0]!r}"
        with pytest.raises(IllegalAddress):
            waiter.synchronize()
        with pytest.raises(IllegalAddress, match="unusable"):
            waiter.synchronize()
    finally:
        with contextlib.suppress(KvtierError):
            counter.close()


def test_elapsed_ms_of_events_not_yet_complete_raises_not_ready_as_cuda_does():
    """``CudaEvent.elapsed_ms`` is a bare ``cudaEventElapsedTime``, which returns ``cudaErrorNotReady`` while either
    event has not completed (the caller must synchronize first). The emulator's ``EmulatedEvent.elapsed_ms`` used to
    synchronize both events itself and return a time, so code that forgot to wait passed every emulated test and
    failed on the GPU. Like the CUDA runtime, it raises (RuntimeCallError, cudaErrorNotReady) when an event is
    recorded but not complete, and returns a time once both are. (Found adversarially, issue #13.)"""
    runtime = EmulatedRuntime("split", schedule="lazy", seed=0)
    stream = runtime.create_stream(0)
    start, end = runtime.create_event(0, timing=True), runtime.create_event(0, timing=True)
    start.record(stream)
    runtime.busy(stream, 50)
    end.record(stream)
    try:
        with pytest.raises(RuntimeCallError, match="cudaErrorNotReady"):
            start.elapsed_ms(end)
    finally:
        stream.synchronize()
    assert start.elapsed_ms(end) >= 0.0
    stream.close()


def test_an_event_recorded_on_an_idle_stream_is_complete_at_once_as_on_a_gpu():
    """A GPU completes an event recorded on a stream with nothing queued without running anything; the emulator
    does too (the cache records one on every insert, and on a lazy schedule they used to wait for a synchronize).
    One recorded behind queued work still waits for it (the test above)."""
    runtime = EmulatedRuntime("split", schedule="lazy", seed=0)
    stream = runtime.create_stream(0)
    start, end = runtime.create_event(0, timing=True), runtime.create_event(0, timing=True)
    start.record(stream)
    end.record(stream)
    assert start.elapsed_ms(end) >= 0.0
    stream.close()


def test_copies_are_checked_when_queued_and_again_when_they_run(split):
    dev = DeviceBuffer(4096, 0, runtime=split)
    address = dev.address
    dev.close()
    scratch = np.zeros(4096, np.uint8)
    with pytest.raises(RuntimeCallError, match="not mapped"):
        split.memcpy(CpuAddress(scratch.ctypes.data), address, 4096)
    with HostBuffer.allocate(4096, runtime=split) as buf, pytest.raises(RuntimeCallError, match="runs past"):
        split.memcpy(CpuAddress(scratch.ctypes.data), buf.cpu_address, 8192)
    lazy = EmulatedRuntime("split", schedule="lazy")
    buf = HostBuffer.allocate(4096, runtime=lazy)
    with DeviceBuffer(4096, 0, runtime=lazy) as dev:
        stream = lazy.create_stream(0)
        lazy.memcpy_async(dev.address, buf.cpu_address, 4096, stream=stream)
        lazy.host_unregister(buf.chunks[0][0].value)
        with pytest.raises(IllegalAddress, match="unregistered before the copy ran"):
            stream.synchronize()
    lazy.host_register(buf.chunks[0][0].value, 4096)
    buf.close()


def test_copy_may_not_span_two_registrations(split):
    with HostBuffer.allocate(8192, runtime=split, granularity=4096, register_chunk_bytes=4096) as buf, \
            DeviceBuffer(8192, 0, runtime=split) as dev:
        with pytest.raises(RuntimeCallError, match="span two registrations"):
            split.memcpy(dev.address, buf.cpu_address, 8192)
        split.memcpy(dev.address, buf.cpu_address, 4096)
        split.memcpy(dev.address + 4096, buf.cpu_address + 4096, 4096)


def test_device_free_waits_for_queued_work_like_cudafree():
    lazy = EmulatedRuntime("split", schedule="lazy")
    data = random_bytes(4096)
    with HostBuffer.allocate(4096, HostKind.PINNED, runtime=lazy) as host:
        view = host.as_tensor().numpy()
        view[:] = 0x33
        dev = DeviceBuffer(4096, 0, runtime=lazy)
        dev.upload(data)
        stream = lazy.create_stream(0)
        lazy.memcpy_async(host.cpu_address, dev.address, 4096, stream=stream)
        assert (view == 0x33).all()
        dev.close()
        np.testing.assert_array_equal(view, data)
        del view


def test_pageable_upload_may_land_after_memcpy_returns():
    """cudaMemcpy from pageable memory returns once the source is staged: a non-blocking stream that does not
    wait for the legacy stream can read the old bytes (which is why pointer tables synchronize after upload)."""
    lazy = EmulatedRuntime("split", schedule="lazy")
    source = np.full(4096, 0x77, np.uint8)
    with DeviceBuffer(4096, 0, runtime=lazy) as dev, HostBuffer.allocate(4096, HostKind.PINNED, runtime=lazy) as out:
        lazy.memcpy(dev.address, CpuAddress(source.ctypes.data), 4096)
        source[:] = 0
        stream = lazy.create_stream(0)
        lazy.memcpy_async(out.cpu_address, dev.address, 4096, stream=stream)
        stream.synchronize()
        assert (out.as_tensor().numpy() != 0x77).all()
        lazy.legacy_stream(0).synchronize()
        assert dev.download() == bytes([0x77]) * 4096


def test_device_memory_is_bounded():
    rt = EmulatedRuntime("split", device_memory_bytes=1 << 20)
    with DeviceBuffer(1 << 20, 0, runtime=rt), pytest.raises(RuntimeCallError, match="cudaErrorMemoryAllocation"):
        DeviceBuffer(1, 0, runtime=rt)


def test_programs_run_on_their_own_device(split):
    stream = split.create_stream(1)
    with pytest.raises(WrongDeviceError, match="device 0"):
        split.launch(split.load_program(XOR, 0), "xor", grid=1, block=32, stream=stream, args=[])
    program = split.load_program(XOR, 1)
    with DeviceBuffer(64, 0, runtime=split) as other, pytest.raises(WrongDeviceError, match="device 1"):
        split.launch(program, "xor", grid=1, block=32, stream=stream, args=[other.address, other.address, i64(64),
                                                                            i64(1)])
    assert split.load_program(XOR, 1) is program


@pytest.mark.parametrize("spec, match", [("emulated:split:x", "'x' is neither"), ("emulated:tiled", "mode 'tiled'"),
                                         ("emulated:split:0", "1..64 devices")])
def test_bad_emulated_specs_say_what_is_wrong(spec, match):
    from kvtier.errors import RuntimeUnavailable

    with pytest.raises(RuntimeUnavailable, match=match):
        create(spec)
    assert create("emulated:unified:3:lazy").device_count() == 3


@pytest.mark.parametrize("spec", MODES)
def test_a_kernel_past_the_end_of_device_memory_is_not_blamed_on_a_cpu_address(spec):
    """A device-resident index past its tensor (unchecked, as in SGLang) makes the emulated kernel fault at an
    address inside the emulator's device-memory space (0x5000...). The fault says 'kernels need the device alias of
    registered host memory, not its CPU address' (emulated_device.py:60-62), sending the reader to hunt an alias bug
    that is not there, in the one message the emulator exists to make clear. Fix: word the hint by the address's
    range (device memory: past an allocation; the alias space: unregistered or freed host memory; below
    ``EMULATED_SPACE``: a CPU address)."""
    rt = create(spec)
    n, row = 8, 32
    a, b = device(rt, (n, row)), device(rt, (n, row), data=False)
    io.transfer_kv_per_layer_mla(a, b, dev_idx(rt, [0, 1 << 40]), dev_idx(rt, [0, 1]), row)
    with pytest.raises(IllegalAddress) as caught:
        rt.synchronize(0)
    assert "CPU address" not in str(caught.value), str(caught.value)


def test_the_unified_emulator_reads_an_index_tensor_across_two_registration_chunks():
    """In ``emulated:unified`` the chunks of a HostBuffer registered in pieces continue each other (alias == CPU
    address), and kvtier's resolver rightly accepts an index tensor (or a tensor item) crossing a chunk boundary, as
    real unified-addressing hardware reads it fine. The emulated kernel, though, read the 32 index bytes through
    ``AddressMap.translate``, which needed one mapping: it raised IllegalAddress on the stream and poisoned device 0
    for the rest of the process. Fixed: an access may run into the next mappings where they continue the last in
    both address and backing. (found adversarially, issue #15)"""
    rt = create("emulated:unified")
    n, row = 16, 32
    buffer = HostBuffer.allocate(2 * 4096, HostKind.REGISTERED, runtime=rt, register_chunk_bytes=4096)
    assert len(buffer.chunks) == 2
    idx = buffer.as_tensor(torch.int64)
    idx.copy_(torch.arange(1024) % n)
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    s_idx, d_idx = idx[510:514], idx[600:604]                  # s_idx crosses the chunk boundary at 4096 bytes
    io.transfer_kv_per_layer_mla(src, dst, s_idx, d_idx, row)
    rt.synchronize(0)
    want = torch.full((n, row), POISON, dtype=torch.uint8)
    want[d_idx.tolist()] = src.cpu()[s_idx.tolist()]
    assert torch.equal(dst.cpu(), want)
    del s_idx, d_idx, idx
