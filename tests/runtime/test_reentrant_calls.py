"""Runtime calls that a finalizer makes from inside a running emulated kernel, and frees another thread asks for
while one runs.

An emulated kernel runs Python, so the garbage collector can run inside it and with it the finalizer of any buffer
held in a reference cycle. A free must then wait for the kernel to end (as cudaFree waits on a GPU), not drain the
stream from the middle of it and run what is queued behind, nor run before the kernel's fault is recorded or its
phases are put back on its stream; a wait (or a poll that would step the schedule) there cannot be honoured and is
refused by name. A free asked for from another thread as the kernel ends is not stranded.
The collector is run at the kernel's first chunk (the pause point ``reference.copy_chunk``): the moment an
allocation there could trigger it, forced.
"""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest
import torch
from helpers.operands import (
    all_poison,
    at_point,
    collect_inside_first_kernel,
    collections_only_when_asked,  # noqa: F401 (a fixture)
    dev_idx,
    device,
    host,
    in_thread,
    poison,
    rnd,
)
from helpers.pools import fill_host, poison_device, read_device

from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import IllegalAddress, KvtierError, RuntimeCallError
from kvtier.memory import HostBuffer, HostKind
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime import create
from kvtier.transfer import TransferEngine

POISON = 0x5A
ROWS, ROW = 8, 16


class Cycle:
    """Garbage only the collector frees: it refers to itself."""

    def __init__(self, payload) -> None:
        self.me, self.payload = self, payload


def cyclic_device_array(rt):
    """A DeviceArray only the collector frees (held in a reference cycle)."""
    Cycle(DeviceArray.from_tensor(torch.ones(16, dtype=torch.uint8), runtime=rt))


def _random(runtime) -> DeviceArray:
    return DeviceArray.from_tensor(torch.randint(1, 255, (ROWS, ROW), dtype=torch.uint8), runtime=runtime)


def _poisoned(runtime) -> DeviceArray:
    return DeviceArray.from_tensor(torch.full((ROWS, ROW), POISON, dtype=torch.uint8), runtime=runtime)


def _two_chained_copies(runtime):
    """K1 copies a -> b and K2 copies b -> c on one stream, both queued before either runs (lazy schedule). Run once
    first, so that the run under test only queues the two kernels (a first call also uploads its tables)."""
    a, b, c = _random(runtime), _poisoned(runtime), _poisoned(runtime)
    rows = DeviceArray.from_tensor(torch.arange(ROWS), runtime=runtime)

    def run():
        io.transfer_kv_per_layer_mla(a, b, rows, rows, ROW)
        io.transfer_kv_per_layer_mla(b, c, rows, rows, ROW)
        runtime.synchronize(0)
    run()
    for x in (b, c):
        x.copy_(torch.full((ROWS, ROW), POISON, dtype=torch.uint8))
    return a, b, c, run


@pytest.mark.parametrize("mode", ["split", "unified"])
def test_a_host_buffer_collected_inside_a_kernel_is_freed_after_it_and_stream_order_holds(mode):
    runtime = create(f"emulated:{mode}:lazy")
    a, b, c, run = _two_chained_copies(runtime)
    buffer = HostBuffer.allocate(4096, HostKind.PINNED, runtime=runtime)
    address = buffer.cpu_address.value
    Cycle(buffer)
    del buffer
    collect_inside_first_kernel(run)
    assert torch.equal(b.cpu(), a.cpu())
    assert torch.equal(c.cpu(), a.cpu()), "the free ran K2 before K1 had written b"
    assert runtime.host_range(address) is None
    assert runtime.pointer_attributes(address).type.name == "UNREGISTERED"


def test_a_device_free_inside_a_kernel_happens_once_the_kernel_ends():
    runtime = create("emulated:split:lazy")
    a, b, c, run = _two_chained_copies(runtime)
    doomed = DeviceArray.from_tensor(torch.ones(64, dtype=torch.uint8), runtime=runtime)
    address = doomed.data_ptr()
    Cycle(doomed)
    del doomed
    collect_inside_first_kernel(run)
    assert torch.equal(c.cpu(), a.cpu())
    assert runtime.pointer_attributes(address).type.name == "UNREGISTERED"
    with pytest.raises(RuntimeCallError, match="not a device allocation"):
        runtime.device_free(address)


def test_a_wait_from_inside_a_kernel_is_refused_by_name_and_runs_nothing_out_of_order():
    runtime = create("emulated:split:lazy")
    a, b, c, run = _two_chained_copies(runtime)
    errors: list[BaseException] = []

    class Waits:
        def __del__(self) -> None:
            try:
                runtime.synchronize(0)
            except BaseException as error:  # noqa: BLE001
                errors.append(error)

    Cycle(Waits())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collect_inside_first_kernel(run)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeCallError)
    assert "inside a running emulated operation" in str(errors[0])
    assert torch.equal(c.cpu(), a.cpu())


@pytest.mark.usefixtures("collections_only_when_asked")
def test_a_free_deferred_past_a_faulting_kernel_does_not_run_the_kernels_queued_behind_it():
    """K1 faults (a device-resident index far past its tensor: SGLang does not check those, nor does kvtier without
    KVTIER_COMPAT_CHECKS); K2, queued behind it on the same stream, writes a pinned host buffer. As on a GPU the
    emulator drops the work queued behind a fault: without a collection K2 never runs (checked first). But when the
    collector frees an unrelated DeviceArray inside K1, the free deferred to K1's end runs in ``Scheduler._run``'s
    ``finally`` (emulated_scheduler.py:97-106), before ``_step`` records K1's fault (line 155), and its drain runs K2:
    K2's bytes land in host memory after the device faulted. Fix: run deferred frees in ``_step`` after the fault is
    recorded (a faulted device is not drained), or record the fault inside ``_run`` before the releases."""
    def run(collect):
        rt = create("emulated:split:lazy")
        n, row = 8, 32
        a, b, d = device(rt, (n, row)), device(rt, (n, row)), device(rt, (n, row), data=False)
        h = host(rt, (n, row), data=False)
        good, two, bad = dev_idx(rt, list(range(n))), dev_idx(rt, [0, 1]), dev_idx(rt, [0, 1 << 40])
        io.transfer_kv_per_layer_mla(a, d, two, two, row)       # both plans built now: no upload below
        io.transfer_kv_per_layer_mla(b, h, good, good, row)
        rt.synchronize(0)
        poison(h)
        cyclic_device_array(rt)
        io.transfer_kv_per_layer_mla(a, d, bad, two, row)       # K1: faults
        io.transfer_kv_per_layer_mla(b, h, good, good, row)     # K2
        with at_point("reference.copy_chunk", gc.collect if collect else lambda: 0) as done, \
                pytest.raises(IllegalAddress):
            rt.synchronize(0)
        assert done
        return all_poison(h)

    assert run(collect=False), "control: K2 ran after K1 faulted even without a collection"
    assert run(collect=True), "K2 ran after K1 faulted: the deferred free drained the stream before the fault"


@pytest.mark.usefixtures("collections_only_when_asked")
def test_a_free_deferred_past_the_launch_of_a_phased_kernel_does_not_let_its_wait_return_early():
    """A per-layer kernel-backend load runs as a generator kernel (phases, layer counters). The collector can run
    when that generator object is allocated, inside the launch operation: it frees a DeviceArray held in a cycle,
    deferred to the operation's end. ``Scheduler._run``'s ``finally`` runs that free, draining the device, before
    ``_step`` puts the kernel back at the head of its stream as ``Running`` (emulated_scheduler.py:151-153). The
    drain so runs the load's completion marker ahead of the kernel, then gives up on the layer-signal waits
    ('waits on work that can never run'), so the free is dropped with only a RuntimeWarning (a leak), and
    ``load.wait()`` returns while the pages are still poison; they land later. Fix: run deferred releases after
    ``_step`` has queued the ``Running`` (and recorded any fault), never from inside ``_run``."""
    rt = create("emulated:split:lazy")
    g = KVGeometry.mha(layers=4, kv_heads=1, head_dim=32, itemsize=2, page_size=4)
    dev = DevicePool.allocate(g, pages=4, device=0, runtime=rt)
    pool = HostPool.allocate(g, "layer_first", pages=4, kind="pinned", runtime=rt)
    engine = TransferEngine(dev, pool, backend="kernel")
    try:
        snapshot = fill_host(pool).reshape(g.tensors, g.layers, 4, -1)
        engine.load([0, 1], [2, 3]).wait()
        poison_device(dev)
        cyclic_device_array(rt)
        load = engine.load([0, 1], [2, 3])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with at_point("reference.phased_copy", gc.collect) as done:
                load.wait()
        assert done and done[0] > 0
        for tensor in range(g.tensors):
            for layer in range(g.layers):
                got = read_device(dev, tensor, layer)
                assert np.array_equal(got[2:4], snapshot[tensor, layer, 0:2]), \
                    f"load.wait() returned before tensor {tensor} layer {layer} landed"
        assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    finally:
        rt.synchronize(0)
        engine.close()
        pool.close()
        dev.close()


@pytest.mark.usefixtures("collections_only_when_asked")
def test_an_event_polled_from_a_finalizer_inside_a_kernel_does_not_run_the_next_kernel_first():
    """Eager schedule, K1 copies a -> b and K2 b -> c on one stream (so c must equal a). The collector runs, inside
    K1, the ``__del__`` of an object that polls an event (``Transfer.done()``, a page manager asking whether its copy
    finished). Waits are refused there, but ``EmulatedEvent.query`` -> ``Scheduler.progress`` runs
    ``_step()`` directly (emulated_scheduler.py:164-168; ``advance()`` at an enqueue does the same): K2, now the head
    of the stream, runs before K1 has written b, and c is poison. On a GPU a query runs nothing. Fix: while
    ``_depth`` is non-zero, ``progress`` and ``advance`` must not step (a query just reports the marker)."""
    rt = create("emulated:split")
    n, row = 8, 32
    a, b, c = device(rt, (n, row)), device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    si = dev_idx(rt, list(range(n)))
    stream, blocker, side = rt.create_stream(0), rt.create_stream(0), rt.create_stream(0)
    with rt.use_stream(stream):
        io.transfer_kv_per_layer_mla(a, b, si, si, row)
        io.transfer_kv_per_layer_mla(b, c, si, si, row)
    poll = rt.create_event(0)
    poll.record(side)
    rt.synchronize(0)
    poison(b), poison(c)
    gate = rt.create_event(0)
    rt.busy(blocker, 300)                  # K1 and K2 stay queued until the sync below
    gate.record(blocker)
    stream.wait(gate)
    with rt.use_stream(stream):
        io.transfer_kv_per_layer_mla(a, b, si, si, row)     # K1
        io.transfer_kv_per_layer_mla(b, c, si, si, row)     # K2

    class Poller:
        def __del__(self):
            self.polled = poll.query()

    poller = Poller()
    poller.me = poller
    del poller
    with at_point("reference.copy_chunk", gc.collect) as done:
        stream.synchronize()
    assert done and done[0] > 0
    assert torch.equal(b.cpu(), a.cpu())
    assert torch.equal(c.cpu(), a.cpu()), "K2 ran (from the event poll) before K1 had written b"


@pytest.mark.usefixtures("collections_only_when_asked")
def test_ok_waits_from_a_finalizer_inside_a_kernel_are_refused_by_name_and_order_holds():
    """Lazy schedule, K1 a -> b then K2 b -> c on one stream. Inside K1 a finalizer tries every wait: the stream's
    and an event's ``synchronize``, ``rt.synchronize`` and an event ``query`` (which waits on the lazy schedule):
    each raises RuntimeCallError naming the running operation, nothing runs out of order (c == a), and a DeviceArray
    the collector freed there is freed after K1 (its memory unmapped, later uses refused)."""
    rt = create("emulated:split:lazy")
    n, row = 8, 32
    a, b, c = device(rt, (n, row)), device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    si = dev_idx(rt, list(range(n)))
    io.transfer_kv_per_layer_mla(a, b, si, si, row)
    io.transfer_kv_per_layer_mla(b, c, si, si, row)
    rt.synchronize(0)
    poison(b), poison(c)
    event = rt.create_event(0)
    freed = DeviceArray.from_tensor(torch.ones(16, dtype=torch.uint8), runtime=rt)
    io.transfer_kv_per_layer_mla(a, b, si, si, row)
    event.record(rt.legacy_stream(0))
    io.transfer_kv_per_layer_mla(b, c, si, si, row)
    refused = []

    class Waiter:
        def __del__(self):
            for wait in (rt.legacy_stream(0).synchronize, event.synchronize, lambda: rt.synchronize(0), event.query):
                try:
                    wait()
                except RuntimeCallError as error:
                    refused.append("inside a running emulated operation" in str(error))

    waiter = Waiter()
    waiter.me = waiter
    waiter.freed, address = freed, freed.address
    del waiter, freed
    with at_point("reference.copy_chunk", gc.collect) as done:
        rt.synchronize(0)
    assert done and refused == [True] * 4
    assert torch.equal(c.cpu(), a.cpu())
    with pytest.raises(KvtierError):
        rt.memcpy(address, address, 16)


@pytest.mark.usefixtures("collections_only_when_asked")
def test_a_release_deferred_from_another_thread_as_the_running_op_ends_is_not_stranded():
    """Thread A runs an emulated kernel; thread B closes a viewed registered HostBuffer meanwhile.
    ``EmulatedRuntime.after_device_work`` (emulated.py:143-151) calls ``Scheduler.after_running`` without taking the
    runtime lock, and ``after_running`` (emulated_scheduler.py:86-97, the append at 95) reads ``_depth``, which
    counts operations running in *any* thread, then appends to ``_deferred``. If A's operation ends between B's
    check and B's append (forced here by holding B at the append), A's ``_release_deferred`` has already run and
    nothing runs the release again until some later operation steps: the buffer stays registered and mapped after
    both threads are done and the device is idle (a leak; a pool re-allocated in a loop leaks each time), and it is
    finally unregistered at an arbitrary later step of unrelated work (here: the next download). Fix: take the
    scheduler lock in ``after_running`` (or in ``after_device_work``) before reading ``_depth``; only the thread
    running the operation holds the lock inside it, so any other thread then waits for the operation's end and
    releases at once. (Since the fix B cannot reach the append while A's operation runs: B waits where it takes the
    lock, and the point at the append, where B is held until A is done, is reached only without the fix.)"""
    rt = create("emulated:split:lazy")
    n, row = 8, 64
    buffer = HostBuffer.allocate(n * row, HostKind.REGISTERED, runtime=rt)
    address = buffer.cpu_address.value
    view = buffer.as_tensor(torch.uint8)
    view.copy_(rnd((n * row,)))
    del view
    a, b, si = device(rt, (n, row)), device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))
    io.transfer_kv_per_layer_mla(a, b, si, si, row)
    in_op, proceed, checked, a_done = (threading.Event() for _ in range(4))

    def hold_a():
        in_op.set()
        assert proceed.wait(60)

    def hold_b():   # B is about to ask whether an op runs; with the fix it waits there for A's op to end
        checked.set()

    def defer_b():  # B found A's op running and is about to defer its release: A ends first
        assert a_done.wait(60)

    with at_point("reference.copy_chunk", hold_a, thread="A"), \
            at_point("scheduler.after_running", hold_b, thread="B"), \
            at_point("scheduler.deferring", defer_b, thread="B", must_reach=False):
        thread_a, errors_a = in_thread(lambda: rt.synchronize(0), name="A")
        assert in_op.wait(60)
        thread_b, errors_b = in_thread(buffer.close, name="B")
        assert checked.wait(60)
        proceed.set()
        thread_a.join(60)
        a_done.set()
        thread_b.join(60)
    assert not errors_a and not errors_b, (errors_a, errors_b)
    rt.synchronize(0)   # nothing queued: runs nothing
    assert buffer.closed
    assert rt.host_range(address) is None, "the closed buffer is still registered: its release was stranded"
    assert torch.equal(b.cpu(), a.cpu())


def test_a_device_array_collected_while_a_kernel_runs_does_not_run_the_next_kernel_first():
    """Two compat calls on one stream: K1 copies a -> b, K2 copies b -> c, so c must equal a. While the emulated
    device runs K1 (``Scheduler._step``, under the runtime's RLock), the garbage collector frees an unrelated
    DeviceArray that sat in a reference cycle: its finalizer calls ``EmulatedRuntime.device_free``, which re-enters
    the RLock and drains the device (``_drain_before_free`` -> ``Scheduler.drain``), running K2, queued behind K1,
    before K1 has written b. c ends up poison: a stream-order violation (wrong bytes) that no GPU can show, since
    cudaFree cannot run inside a kernel. Any Python allocation inside an emulated kernel may trigger the collector, so
    any CI test that drops cyclic garbage holding device or host buffers (an exception kept with its traceback, an
    object graph with back-references) can read stale bytes now and then. Forced: the lazy schedule (K1 and K2 both
    queued before anything runs) and ``gc.collect()`` at the first chunk of K1, the moment an allocation there could
    trigger it. (A generator kernel, e.g. the engine's signalled copies, would fault instead: its own generator is
    re-entered.)"""
    rt = create("emulated:split:lazy")
    n, row = 8, 16
    a, b, c = device(rt, (n, row)), device(rt, (n, row), data=False), device(rt, (n, row), data=False)
    si, di = dev_idx(rt, list(range(n))), dev_idx(rt, list(range(n)))
    io.transfer_kv_per_layer_mla(a, b, si, di, row)
    io.transfer_kv_per_layer_mla(b, c, si, di, row)
    rt.synchronize(0)
    poison(b), poison(c)

    class Node:
        pass

    cyclic = Node()
    cyclic.me, cyclic.array = cyclic, DeviceArray.from_tensor(torch.ones(16, dtype=torch.uint8), runtime=rt)
    del cyclic
    io.transfer_kv_per_layer_mla(a, b, si, di, row)     # K1
    io.transfer_kv_per_layer_mla(b, c, si, di, row)     # K2, after K1 on the same stream
    collect_inside_first_kernel(lambda: rt.synchronize(0))
    assert torch.equal(b.cpu(), a.cpu())
    assert torch.equal(c.cpu(), a.cpu()), "K2 ran before K1 had written b"
