"""Adversarial tests (issue 13b): the emulator's scheduler and events, ``after=`` taking a ``Transfer`` everywhere,
and ``FamilyEngine``'s launcher settings. One failing test per defect; each docstring says what is wrong, what was
expected and where the fault is suspected."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvtier.cache import CacheSettings, KVCache, Namespace
from kvtier.errors import IllegalAddress, KvtierError, RuntimeCallError
from kvtier.kernels import KernelLauncher
from kvtier.memory import DeviceBuffer
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.pools.state import StateDevicePool, StateGeometry, StateHostPool
from kvtier.runtime.emulated import EmulatedRuntime
from kvtier.transfer import TransferEngine
from kvtier.transfer.family import FamilyEngine


def test_a_wait_value_on_an_unmapped_address_poisons_its_own_device_only():
    """``EmulatedRuntime._wait_value`` promises: "The counter is read through the device's map when the scheduler
    considers the wait, so an address the device cannot see faults then, as a GPU's would", and the scheduler
    promises that a fault poisons *that* device (its queued work dropped, the next call that observes it raises the
    fault, later calls raise "unusable"). But the read happens in ``Scheduler._runnable`` (via ``_pick``), outside
    the ``try``/``_fault`` of ``_step``: the IllegalAddress escapes from whatever call happened to schedule work,
    device 0 is never marked faulted, and its wait stays queued forever. Observed: every enqueue / synchronize on
    healthy device 1 raises device 0's IllegalAddress, over and over (and the DeviceBuffer finalizer raises at exit).
    Expected: device 1 keeps working; device 0 reports the fault once, then "unusable".
    Suspected: ``Scheduler._runnable`` / ``_pick`` / ``_step`` (kvtier/runtime/emulated_scheduler.py) and
    ``WaitValueOp.ready`` (kvtier/runtime/emulated_device.py)."""
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
    event has not completed (the caller must synchronize first). The emulator's ``EmulatedEvent.elapsed_ms``
    synchronizes both events itself and returns a time, so code that forgets to wait passes every emulated test and
    fails on the GPU. Expected: like the CUDA runtime, raise (RuntimeCallError, cudaErrorNotReady) when an event is
    recorded but not complete; return a time once both are. Suspected: ``EmulatedEvent.elapsed_ms``
    (kvtier/runtime/emulated_device.py)."""
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


def test_kvcache_after_accepts_a_transfer_like_every_engine():
    """A ``Transfer`` is now a valid ``after=`` ("a Transfer is a valid after=": ``order_after`` in
    kvtier/transfer/ordering.py, which says "Every engine orders through here"). ``KVCache`` takes ``after=`` on
    ``insert``/``free``/``backup``/``load_back`` but converts it in its own ``KVCache._markers``, which knows events and
    streams only: ``cache.insert(tokens, pages, after=load)`` with ``load`` a Transfer raises
    ``WrongRuntime("emulated:split needs one of its own streams, got Transfer(...)")`` — a message that calls the
    Transfer a foreign stream. Expected: the cache orders after the Transfer's ``finished`` event, as the engines do
    (passing ``after=load.finished`` works). Suspected: ``KVCache._markers`` (kvtier/cache/cache.py)."""
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


def test_family_engine_checks_its_threads_against_the_launcher_up_front():
    """Issue 13 made ``TransferEngine`` refuse, when it is built, a ``threads`` its launcher cannot run
    (``launcher.check_threads(threads, max_blocks)`` in ``TransferEngine.__init__``). ``FamilyEngine`` has "the same
    contract as TransferEngine" but no such check: ``FamilyEngine(dev, host, launcher=KernelLauncher(rt,
    max_threads=256))`` (threads defaults to 1024) is built, and the mismatch surfaces only at the first backup or
    load, as a KvtierError from deep inside the launch. Expected: the constructor refuses the pair (as TransferEngine
    does). Suspected: ``FamilyEngine.__init__`` (kvtier/transfer/family.py)."""
    runtime = EmulatedRuntime("split", seed=0)
    g = StateGeometry.compress_state(2, (4, 8))
    dev = StateDevicePool.allocate(g, 3, 0, runtime=runtime)
    host = StateHostPool.allocate(g, "page_first", slots=3, runtime=runtime)
    launcher = KernelLauncher(runtime, max_threads=256)
    # the reference behaviour: the KV engine refuses the same pair when it is built
    kv = KVGeometry.mha(2, kv_heads=2, head_dim=16, itemsize=2, page_size=4)
    kv_dev = DevicePool.allocate(kv, 2, 0, runtime=runtime)
    kv_host = HostPool.allocate(kv, "page_first", pages=2, runtime=runtime)
    try:
        with pytest.raises(KvtierError, match="256"):
            TransferEngine(kv_dev, kv_host, launcher=launcher).close()
        engine = None
        try:
            with pytest.raises(KvtierError, match="256"):
                engine = FamilyEngine(dev, host, launcher=launcher)
        finally:
            if engine is not None:
                engine.close()
    finally:
        kv_host.close()
        kv_dev.close()
        host.close()
        dev.close()
