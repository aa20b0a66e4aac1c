"""Adversary round 9 (issue #15): the round-8 fixes under attack (frees deferred past a running emulated operation,
waits refused there, fork-safe module locks, lock-free address lookups), and kvtier.compat.sglang.kvcacheio as an
SGLang user calls it (refusals, empty and negative indices, offset views, mixed memory kinds). Tests not named
``test_ok_*`` fail on a defect (each docstring says what goes wrong, why it matters and a fix); ``test_ok_*`` tests
document attacks that held. Races and collections are forced with trace functions that pick the moment they happen
(never with sleeps); every destination is poisoned first and checked byte for byte against fresh random data."""

from __future__ import annotations

import functools
import gc
import inspect
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.operands import (
    MODES,
    POISON,
    all_poison,
    at_line,
    close_when_collected,
    dev_idx,
    device,
    fresh,
    no_automatic_collection,
    pin_idx,
    poison,
    rnd,
    run_in_fork,
    traced,
)
from helpers.pools import fill_host, poison_device, read_device

import kvtier
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.errors import IllegalAddress, KvtierError, RuntimeCallError
from kvtier.kernels import reference
from kvtier.locks import ForkSafeLock
from kvtier.memory import HostBuffer, HostKind
from kvtier.pools import DevicePool, HostPool, KVGeometry
from kvtier.runtime import create, emulated
from kvtier.transfer import TransferEngine

_keep: list = []




def host(rt, shape, data=True, kind=HostKind.PINNED):
    buffer = HostBuffer.allocate(int(np.prod(shape)), kind, runtime=rt)
    _keep.append(buffer)
    tensor = buffer.as_tensor(torch.uint8).view(shape)
    tensor.copy_(rnd(shape) if data else torch.full(shape, POISON, dtype=torch.uint8))
    return tensor


















class Node:
    """An object in a reference cycle: only the cyclic collector frees it (and what it holds)."""


def cyclic_device_array(rt):
    node = Node()
    node.me, node.array = node, DeviceArray.from_tensor(torch.ones(16, dtype=torch.uint8), runtime=rt)






@pytest.fixture(autouse=True)
def _collections_only_when_asked():
    """No automatic collection: cyclic garbage goes exactly where a test calls ``gc.collect()``."""
    with no_automatic_collection():
        yield


# -- defects: memory given back under queued or running work -------------------------------------------------------
@pytest.mark.parametrize("kind", [HostKind.REGISTERED, HostKind.SHM])
@pytest.mark.parametrize("spec", ["emulated:split:lazy", "emulated:unified:lazy"])
def test_a_host_buffer_collected_while_a_copy_over_it_is_queued_is_not_unmapped_under_it(kind, spec):
    """A compat kernel reading a view of a 'registered' (kvtier's default) or 'shm' HostBuffer is queued; the caller
    drops the view and the buffer, as torch code drops a tensor after queuing work on it. A HostBuffer and its anchor
    form a reference cycle (``self._anchor.owner = self``), so the cyclic collector frees it; its finalizer
    (``host_buffer._release`` -> ``_Resources.release``, host_buffer.py:96 -> 54-69) unregisters and unmaps at once:
    unlike ``close()`` it never waits for the devices, and the emulator's ``_host_unregister`` (emulated.py:150) neither
    drains nor defers. The queued kernel then faults (IllegalAddress: 'not mapped on this device; kernels need the
    device alias ... not its CPU address', a wrong hint: it was the alias) and the device is poisoned; on a GPU the
    DMA reads unmapped memory. A 'pinned' buffer is fine only because cudaFreeHost drains first
    (``test_ok_a_pinned_host_buffer_collected_while_a_copy_over_it_is_queued_waits_for_it``). Fix: the finalizer
    waits for the devices when the buffer handed out views (as ``close()`` does), deferred with
    ``Scheduler.after_running`` inside an emulated operation, before unregistering."""
    rt = create(spec)
    n, row = 8, 32
    buffer = HostBuffer.allocate(n * row, kind, runtime=rt)
    view = buffer.as_tensor(torch.uint8).view(n, row)
    view.copy_(rnd((n, row)))
    want = view.clone()
    dst = device(rt, (n, row), data=False)
    si = dev_idx(rt, list(range(n)))
    io.transfer_kv_per_layer_mla(view, dst, si, si, row)
    del view, buffer
    assert gc.collect() > 0
    rt.synchronize(0)
    assert torch.equal(dst.cpu(), want)


_CRASH_CHILD = """
import gc, inspect, sys, torch
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.kernels import reference
from kvtier.memory import HostBuffer
from kvtier.runtime import create
rt = create("emulated:split:lazy")
n, row = 8, 1 << 14
buffer = HostBuffer.allocate(n * row, sys.argv[1], runtime=rt)
view = buffer.as_tensor(torch.uint8).view(n, row)
view.copy_(torch.randint(1, 255, (n, row), dtype=torch.uint8))
want = view.clone()
dst = DeviceArray.from_tensor(torch.full((n, row), 0x5A, dtype=torch.uint8), runtime=rt)
si = DeviceArray.from_tensor(torch.arange(n), runtime=rt)
gc.disable()
io.transfer_kv_per_layer_mla(view, dst, si, si, row)
del view, buffer
lines, start = inspect.getsourcelines(reference._copy)
at = start + next(i for i, line in enumerate(lines) if "memory.view(addresses[1]" in line)
code, done = reference._copy.__code__, []
def tracer(frame, event, arg):
    if frame.f_code is not code:
        return None
    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == at and not done:
            done.append(gc.collect())
        return local
    return local
sys.settrace(tracer)
try:
    rt.synchronize(0)
finally:
    sys.settrace(None)
print("collected", done, "right", torch.equal(dst.cpu(), want))
"""


@pytest.mark.parametrize("kind", ["registered", "shm"])
def test_a_host_buffer_collected_inside_the_kernel_reading_it_does_not_crash_the_process(kind):
    """As above, but the collection runs inside the emulated kernel that reads the buffer, between the kernel taking
    its numpy view of the source and copying from it (any allocation there may start a collection; the buffer is
    only ever freed by one, see the test above). ``device_free`` and ``host_free`` (pinned) are deferred to the end
    of the running operation by ``Scheduler.after_running``, but the finalizer of a registered or shm buffer
    unregisters and munmaps on the spot (host_buffer.py:67-69, emulated.py:150), so the kernel reads unmapped memory
    and the whole process dies with SIGSEGV (a pytest run vanishes without a report). Run in a child process. Fix:
    give back registered and shm memory through ``after_running`` too (unregister and unmap once the running
    operation ends, after draining), as the pinned path does."""
    root = str(Path(kvtier.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CRASH_CHILD), kind], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode >= 0, f"the process died of signal {-done.returncode} (SIGSEGV is 11)"
    assert "right True" in done.stdout, done.stdout + done.stderr[-2000:]


def test_closing_a_registered_host_buffer_from_a_finalizer_inside_a_kernel_waits_for_its_queued_copy():
    """K1 (device -> device) and K2 (device -> a view of a registered HostBuffer) are queued on one stream; the
    caller drops its view; an owner object in a reference cycle closes the buffer in ``__del__`` (the pattern of the
    collector's own docstring: ``weakref.finalize(engine, pool.close)``). The collector runs that finalizer inside K1.
    ``close()`` asks every device to synchronize, which the round-8 fix refuses there (RuntimeCallError), but close
    swallows every KvtierError of that wait (``contextlib.suppress(KvtierError)``, host_buffer.py:289) and unregisters
    and unmaps at once; K2 then faults on memory it was queued over (IllegalAddress, device poisoned). Fix: a close
    refused its wait there must defer its release past the running operation (``after_running``), draining first,
    not go on as if the device were faulted."""
    rt = create("emulated:split:lazy")
    n, row = 8, 32
    a, b, si = device(rt, (n, row)), device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))
    buffer = HostBuffer.allocate(n * row, HostKind.REGISTERED, runtime=rt)
    view = buffer.as_tensor(torch.uint8).view(n, row)
    io.transfer_kv_per_layer_mla(a, b, si, si, row)
    io.transfer_kv_per_layer_mla(a, view, si, si, row)
    rt.synchronize(0)
    poison(view), poison(b)
    io.transfer_kv_per_layer_mla(a, b, si, si, row)       # K1
    io.transfer_kv_per_layer_mla(a, view, si, si, row)    # K2, into the host buffer
    del view

    close_when_collected(buffer)
    del buffer
    tracer, done = at_line(reference._copy, "source = memory.view", gc.collect)
    traced(tracer, lambda: rt.synchronize(0))
    assert done and done[0] > 0


# -- defects: the deferred free itself -------------------------------------------------------------------------------
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
        tracer, done = at_line(reference._copy, "source = memory.view", gc.collect if collect else lambda: 0)
        with pytest.raises(IllegalAddress):
            traced(tracer, lambda: rt.synchronize(0))
        assert done
        return all_poison(h)

    assert run(collect=False), "control: K2 ran after K1 faulted even without a collection"
    assert run(collect=True), "K2 ran after K1 faulted: the deferred free drained the stream before the fault"


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
        launch = next(c for c in emulated.EmulatedRuntime._launch.__code__.co_consts
                      if inspect.iscode(c) and c.co_name == "<lambda>")
        done = []

        def tracer(frame, event, arg):
            if frame.f_code is not launch:
                return None

            def local(frame, event, arg):
                if event == "return" and inspect.isgenerator(arg) and not done:
                    done.append(gc.collect())
                return local
            return local

        load = engine.load([0, 1], [2, 3])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traced(tracer, load.wait)
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


def test_an_event_polled_from_a_finalizer_inside_a_kernel_does_not_run_the_next_kernel_first():
    """Eager schedule, K1 copies a -> b and K2 b -> c on one stream (so c must equal a). The collector runs, inside
    K1, the ``__del__`` of an object that polls an event (``Transfer.done()``, a page manager asking whether its copy
    finished). The round-8 fix refuses waits there, but ``EmulatedEvent.query`` -> ``Scheduler.progress`` runs
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
    tracer, done = at_line(reference._copy, "source = memory.view", gc.collect)
    traced(tracer, stream.synchronize)
    assert done and done[0] > 0
    assert torch.equal(b.cpu(), a.cpu())
    assert torch.equal(c.cpu(), a.cpu()), "K2 ran (from the event poll) before K1 had written b"


# -- defects: fork -----------------------------------------------------------------------------------------------
def test_a_fork_child_does_not_hang_when_a_parent_thread_is_inside_a_call_running_queued_work():
    """A parent thread is inside a compat call whose first use of new operands builds a kernel table, and the
    table's synchronous upload runs the kernel queued before it on the legacy stream: the thread holds the emulated
    runtime's lock (``Runtime._lock``, a plain ``threading.RLock``, base.py:156) and the scheduler's ``_depth`` is 1
    with any deferred frees pending. The main thread forks. The round-8 fix made the compat module's locks
    ``ForkSafeLock``s, and docs/sglang.md promises 'a process forked while another thread is inside a call gets the
    module's locks unheld in the child, so no child hangs on them', yet the child's first call blocks on the copied,
    held runtime lock for good (on CUDA a fork child's call fails with an error, it does not hang); were that lock
    fresh, ``_depth`` 1 would still refuse every wait in the child and defer every free forever. Fix: re-create the
    emulated runtime's lock and reset the scheduler's ``_depth`` and ``_deferred`` (and drop the parent's queued
    work) in the child (``os.register_at_fork``), or fail the child's calls with a clear error as CUDA does."""
    rt = create("emulated:split:lazy")
    n, row = 8, 32
    a, b, si = device(rt, (n, row)), device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))
    other = device(rt, (n, row), data=False)
    io.transfer_kv_per_layer_mla(a, b, si, si, row)          # queued, runs inside the next call's table upload
    inside, go = threading.Event(), threading.Event()

    def park():
        inside.set()
        go.wait(60)

    tracer, _ = at_line(reference._copy, "source = memory.view", park)

    def worker():
        sys.settrace(tracer)
        try:
            io.transfer_kv_per_layer_mla(a, other, si, si, row)
        finally:
            sys.settrace(None)

    def child_call():
        out = device(rt, (n, row), data=False)
        io.transfer_kv_per_layer_mla(a, out, si, si, row)
        return "ok" if torch.equal(out.cpu(), a.cpu()) else "wrong bytes"

    thread = threading.Thread(target=worker)
    thread.start()
    assert inside.wait(60)
    hung, result = run_in_fork(child_call, meanwhile=lambda: (go.set(), thread.join(60)))
    rt.synchronize(0)
    assert torch.equal(other.cpu(), a.cpu())
    assert not hung, "the fork child hangs on the emulated runtime's lock a parent thread held at fork"
    assert result == "ok"


def _fork_holding(lock):
    with lock:
        pid = os.fork()
        if pid == 0:    # the child leaves the with block the forking thread entered
            code = 0
            try:
                lock.release()
                lock.acquire()
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_fork_safe_lock_held_by_the_forking_thread_stays_held_in_the_child():
    """``ForkSafeLock`` replaces its lock in every fork child (locks.py:42-43), also when the thread that forks is the
    one holding it (a signal handler or finalizer that forks inside a compat call's ``with state.lock``). In the
    child that thread goes on and leaves its ``with`` block: ``release()`` of the fresh, unheld lock raises
    RuntimeError('release unlocked lock'). A ``threading.Lock`` stays held by the forking thread in the child and
    releases fine (checked first), so the drop-in is not one. Fix: remember the owner's thread id on acquire and,
    in the child, re-create the lock held when the owner was the forking thread (it lives on in the child)."""
    assert _fork_holding(threading.Lock()) == 0
    assert _fork_holding(ForkSafeLock()) == 0, "the child could not release the lock its thread held at fork"


# -- defects: errors -------------------------------------------------------------------------------------------------
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


# -- held up ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["emulated:split:lazy", "emulated:unified:lazy"])
def test_ok_a_pinned_host_buffer_collected_while_a_copy_over_it_is_queued_waits_for_it(spec):
    """The pinned twin of the first test: its finalizer's ``host_free`` drains the device first (cudaFreeHost), so the
    queued kernel reads the buffer before it goes, whether the collection runs outside any operation or inside the
    kernel reading it (deferred to its end)."""
    for inside in (False, True):
        rt = create(spec)
        n, row = 8, 32
        buffer = HostBuffer.allocate(n * row, HostKind.PINNED, runtime=rt)
        view = buffer.as_tensor(torch.uint8).view(n, row)
        view.copy_(rnd((n, row)))
        want = view.clone()
        dst, si = device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))
        io.transfer_kv_per_layer_mla(view, dst, si, si, row)
        del view, buffer
        if inside:
            tracer, done = at_line(reference._copy, "memory.view(addresses[1]", gc.collect)
            traced(tracer, functools.partial(rt.synchronize, 0))
            assert done and done[0] > 0
        else:
            assert gc.collect() > 0
            rt.synchronize(0)
        assert torch.equal(dst.cpu(), want)


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
    tracer, done = at_line(reference._copy, "source = memory.view", gc.collect)
    traced(tracer, lambda: rt.synchronize(0))
    assert done and refused == [True] * 4
    assert torch.equal(c.cpu(), a.cpu())
    with pytest.raises(KvtierError):
        rt.memcpy(address, address, 16)


@pytest.mark.parametrize("spec", MODES)
def test_ok_kvcacheio_refusals_leave_every_destination_untouched(spec):
    """One call at a time, each refused with a KvtierError before anything is queued, then the valid call right
    after it lands exactly: index dtypes int16/uint8/float/bool, int32 against int64, lengths that differ, a
    non-contiguous index view, pageable CPU indices, indices on device 1 with operands on device 0, a destination
    on device 1, a DeviceArray of another runtime, a strided operand, item_size 12, a bool layer_id, a host tensor
    that is not kvtier memory, a page-first layer past its layout, and a pinned index past the destination."""
    rt = create(spec)
    n, row, layers = 16, 32, 2
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    paged = host(rt, (n, layers, row))
    other_rt = create(spec)
    si, di = [3, 0, 9, 15], [1, 14, 6, 2]
    good_s, good_d = dev_idx(rt, si), dev_idx(rt, di)
    pageable = rnd((n, row))

    def valid():
        poison(dst)
        io.transfer_kv_per_layer_mla(src, dst, good_s, good_d, row)
        rt.synchronize(0)
        want = fresh((n, row))
        want[di] = src.cpu()[si]
        assert torch.equal(dst.cpu(), want)

    refusals = {
        "int16": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.tensor(si, dtype=torch.int16),
                                                      torch.tensor(di, dtype=torch.int16), row),
        "uint8": lambda: io.transfer_kv_per_layer_mla(src, dst, pin_idx(rt, si).to(torch.uint8),
                                                      pin_idx(rt, di).to(torch.uint8), row),
        "float": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.tensor(si, dtype=torch.float64),
                                                      torch.tensor(di, dtype=torch.float64), row),
        "bool": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.ones(4, dtype=torch.bool),
                                                     torch.ones(4, dtype=torch.bool), row),
        "dtypes": lambda: io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, si, torch.int32), good_d, row),
        "lengths": lambda: io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, si[:3]), good_d, row),
        "strided index": lambda: io.transfer_kv_per_layer_mla(src, dst, pin_idx(rt, si * 2)[::2],
                                                              pin_idx(rt, di), row),
        "pageable index": lambda: io.transfer_kv_per_layer_mla(src, dst, torch.tensor(si), torch.tensor(di), row),
        "index device": lambda: io.transfer_kv_per_layer_mla(src, dst, dev_idx(rt, si, dev=1),
                                                             dev_idx(rt, di, dev=1), row),
        "dst device": lambda: io.transfer_kv_per_layer_mla(
            src, DeviceArray.from_tensor(fresh((n, row)), 1, runtime=rt), good_s, good_d, row),
        "runtime": lambda: io.transfer_kv_per_layer_mla(src, device(other_rt, (n, row), False), good_s, good_d,
                                                        row),
        "strided operand": lambda: io.transfer_kv_per_layer_pf_lf(paged[:, 0], dst, paged[:, 1], dst,
                                                                  pin_idx(rt, si), pin_idx(rt, di), 0, row, row),
        "item_size": lambda: io.transfer_kv_per_layer_mla(src, dst, good_s, good_d, 12),
        "layer bool": lambda: io.transfer_kv_per_layer_mla_pf_lf(paged, dst, good_s, good_d, True, row,
                                                                 layers * row),
        "pageable operand": lambda: io.transfer_kv_per_layer_mla(pageable, dst, pin_idx(rt, si), pin_idx(rt, di),
                                                                 row),
        "layout": lambda: io.transfer_kv_per_layer_mla_pf_lf(paged, dst, good_s, good_d, layers, row,
                                                             layers * row),
        "reach": lambda: io.transfer_kv_per_layer_mla(src, dst, pin_idx(rt, si), pin_idx(rt, [1, 14, 6, n]), row),
    }
    valid()
    for name, call in refusals.items():
        poison(dst)
        with pytest.raises(KvtierError):
            call()
        rt.synchronize(0)
        assert all_poison(dst), name
        valid()


@pytest.mark.parametrize("spec", MODES)
def test_ok_empty_and_negative_indices_across_functions(spec):
    """Empty index tensors (device, pinned, int32 and int64) are a no-op for kernel, table and direct functions,
    and leave every destination as it was; negative indices (-1, int64 min) on either side skip their pair in the
    kernel functions and the rest lands; a negative index in a ``*_direct`` call is refused untouched."""
    rt = create(spec)
    n, row, layers = 16, 32, 2
    src, dst = device(rt, (n, row)), device(rt, (n, row), data=False)
    srcs = [device(rt, (n, row)) for _ in range(layers)]
    dsts = [device(rt, (n, row), data=False) for _ in range(layers)]
    out = host(rt, (n, layers, row), data=False)
    src_table = DeviceArray.from_tensor(torch.tensor([x.data_ptr() for x in srcs], dtype=torch.uint64), runtime=rt)
    for dtype in (torch.int64, torch.int32):
        for make in (dev_idx, pin_idx):
            empty = make(rt, [], dtype)
            io.transfer_kv_per_layer_mla(src, dst, empty, empty, row)
            io.transfer_kv_all_layer_mla_lf_pf(src_table, out, empty, empty, row, layers * row, layers)
        io.transfer_kv_direct(srcs, dsts, torch.tensor([], dtype=dtype), torch.tensor([], dtype=dtype), 1)
    rt.synchronize(0)
    assert all_poison(dst) and all_poison(out) and all(all_poison(d) for d in dsts)
    low = -(1 << 63)
    si, di = [2, -1, 7, 5, low], [4, 9, -1, low, 11]
    for make in (dev_idx, pin_idx):
        poison(dst), poison(out)
        io.transfer_kv_per_layer_mla(src, dst, make(rt, si), make(rt, di), row)
        io.transfer_kv_all_layer_mla_lf_pf(src_table, out, make(rt, si), make(rt, di), row, layers * row, layers)
        rt.synchronize(0)
        want, want_out = fresh((n, row)), fresh((n, layers, row))
        want[4] = src.cpu()[2]
        for layer in range(layers):
            want_out[4, layer] = srcs[layer].cpu()[2]
        assert torch.equal(dst.cpu(), want) and torch.equal(out, want_out)
    with pytest.raises(KvtierError):
        io.transfer_kv_direct(srcs, dsts, torch.tensor([2, -1]), torch.tensor([4, 9]), 1)
    rt.synchronize(0)
    assert all(all_poison(d) for d in dsts)


@pytest.mark.parametrize("spec", MODES)
def test_ok_offset_views_and_mixed_memory_kinds_in_one_call(spec):
    """K on pinned memory, V on registered memory, each a contiguous view starting mid-buffer (a storage offset);
    destinations a DeviceArray ``select`` view and a DeviceArray; indices int32 pinned at an offset. Both directions
    of ``transfer_kv_per_layer`` and ``transfer_kv_per_layer_pf_lf`` (a page-first registered host) land exactly,
    twice (the second call on the kept plan), and a pinned index reaching one item past the view (but inside its
    buffer) is refused untouched."""
    rt = create(spec)
    n, row, layers = 16, 64, 3
    hk_all = host(rt, (n + 5, row))
    hv_all = host(rt, (n + 3, row), kind=HostKind.REGISTERED)
    hk, hv = hk_all[5:], hv_all[3:]
    big = device(rt, (2, n, row), data=False)
    dk, dv = big.select(0, 1), device(rt, (n, row), data=False)
    paged = host(rt, (n, layers, row), kind=HostKind.REGISTERED)
    idx = pin_idx(rt, list(range(40)), torch.int32)
    for _ in range(2):
        si, di = idx[7:13], idx[21:27]
        si.copy_(torch.tensor([15, 0, 4, 9, 11, 2], dtype=torch.int32))
        di.copy_(torch.tensor([1, 3, 5, 7, 13, 15], dtype=torch.int32))
        poison(big), poison(dv)
        io.transfer_kv_per_layer(hk, dk, hv, dv, si, di, row)
        rt.synchronize(0)
        for s, d in ((hk, dk), (hv, dv)):
            want = fresh((n, row))
            want[di.long()] = s[si.long()]
            assert torch.equal(d.cpu(), want)
        assert torch.equal(big.cpu()[0], fresh((n, row)))
        back_k, back_v = hk_all.clone(), hv_all.clone()
        io.transfer_kv_per_layer(dk, hk, dv, hv, di, si, row)
        rt.synchronize(0)
        back_k[5:][si.long()] = dk.cpu()[di.long()]
        back_v[3:][si.long()] = dv.cpu()[di.long()]
        assert torch.equal(hk_all, back_k) and torch.equal(hv_all, back_v)
        poison(big), poison(dv)
        io.transfer_kv_per_layer_pf_lf(paged, dk, paged, dv, si, di, 2, row, layers * row)
        rt.synchronize(0)
        want = fresh((n, row))
        want[di.long()] = paged[si.long(), 2]
        assert torch.equal(dk.cpu(), want) and torch.equal(dv.cpu(), want)
    before_k, before_v = hk_all.clone(), hv_all.clone()
    with pytest.raises(KvtierError):
        io.transfer_kv_per_layer(dk, hk_all[5:-1], dv, hv, idx[0:1], pin_idx(rt, [n - 1], torch.int32), row)
    rt.synchronize(0)
    assert torch.equal(hk_all, before_k) and torch.equal(hv_all, before_v)
