"""A HostBuffer given back while copies over it are queued or running waits for them: collected by the cyclic
collector (outside any operation, or inside the kernel reading it), closed from another thread, closed by an owner's
finalizer the collector runs inside a kernel, or left to interpreter exit. The copy reads every byte, nothing queued
behind it runs early, and only then is the memory unregistered, unmapped or unpinned (an shm file removed).
Collections happen where a test asks (a pause point inside the kernel, or a plain ``gc.collect()``), never
automatically. (Found adversarially, issue #15.)"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.operands import (
    at_point,
    close_when_collected,
    collections_only_when_asked,  # noqa: F401 (a fixture)
    dev_idx,
    device,
    in_thread,
    poison,
    rnd,
)
from helpers.paths import child_env

import kvtier
from kvtier.compat.sglang import kvcacheio as io
from kvtier.memory import HostBuffer, HostKind
from kvtier.runtime import create

pytestmark = pytest.mark.usefixtures("collections_only_when_asked")


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
import gc, sys, torch
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.memory import HostBuffer
from kvtier.pause_points import armed
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
done = []
def collect_once():   # between the kernel taking its view of the source and copying from it
    if not done:
        done.append(gc.collect())
with armed("reference.write_chunk", collect_once):
    rt.synchronize(0)
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
    ``close()`` asks every device to synchronize, which is refused there (RuntimeCallError), but close
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
    with at_point("reference.copy_chunk", gc.collect) as done:
        rt.synchronize(0)
    assert done and done[0] > 0


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
            with at_point("reference.write_chunk", gc.collect) as done:
                rt.synchronize(0)
            assert done and done[0] > 0
        else:
            assert gc.collect() > 0
            rt.synchronize(0)
        assert torch.equal(dst.cpu(), want)


def _filled(rt, kind, n, row):
    """(a host buffer of ``kind``, a view of it holding fresh random rows, a copy of them, a poisoned device
    destination, the row indices)."""
    buffer = HostBuffer.allocate(n * row, kind, runtime=rt)
    view = buffer.as_tensor(torch.uint8).view(n, row)
    view.copy_(rnd((n, row)))
    return buffer, view, view.clone(), device(rt, (n, row), data=False), dev_idx(rt, list(range(n)))


@pytest.mark.parametrize("how", ["close", "collect"])
@pytest.mark.parametrize("kind", [HostKind.REGISTERED, HostKind.SHM, HostKind.PINNED])
def test_ok_a_buffer_closed_or_collected_in_another_thread_while_its_copy_is_queued(kind, how):
    """Lazy schedule: a compat kernel reading a view of the buffer is queued; another thread closes the buffer (or
    drops the last reference and collects it). The release waits for the device: the copy lands, and afterwards the
    registration (or pinned allocation) is gone and an shm file removed."""
    rt = create("emulated:split:lazy")
    n, row = 8, 64
    buffer, view, want, dst, si = _filled(rt, kind, n, row)
    address, path = buffer.cpu_address.value, buffer.path
    io.transfer_kv_per_layer_mla(view, dst, si, si, row)
    del view
    holder = [buffer]
    del buffer

    def drop():
        if how == "close":
            holder[0].close()
        else:
            holder.clear()
            assert gc.collect() > 0
    thread, errors = in_thread(drop)
    thread.join(60)
    assert not errors, errors
    assert rt.host_range(address) is None
    assert path is None or not os.path.exists(path)
    assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("kind", [HostKind.SHM, HostKind.PINNED])
def test_ok_close_from_a_finalizer_inside_the_kernel_reading_the_buffer(kind):
    """The kernel reading an shm (or pinned) buffer's view runs; inside it, a collection runs an owner's
    ``__del__`` that closes the buffer. The release is deferred past the kernel: it reads every byte, the kernel
    queued behind it (into the same buffer) runs after it, and then the memory is given back."""
    rt = create("emulated:split:lazy")
    n, row = 8, 64
    buffer, view, want, dst, si = _filled(rt, kind, n, row)
    address, path = buffer.cpu_address.value, buffer.path
    back, other = device(rt, (n, row), data=False), device(rt, (n, row))
    io.transfer_kv_per_layer_mla(view, dst, si, si, row)       # K1 reads the buffer
    io.transfer_kv_per_layer_mla(other, view, si, si, row)     # K2 writes it
    io.transfer_kv_per_layer_mla(view, back, si, si, row)      # K3 reads K2's bytes
    del view

    close_when_collected(buffer)
    del buffer
    with at_point("reference.copy_chunk", gc.collect) as done:
        rt.synchronize(0)
    assert done and done[0] > 0
    assert torch.equal(dst.cpu(), want)
    assert torch.equal(back.cpu(), other.cpu())
    assert rt.host_range(address) is None
    assert path is None or not os.path.exists(path)


_EXIT_CHILD = """
import atexit, sys
results = {}
def report():   # registered first: runs last, after the finalizers' atexit hook
    print("REPORT", results.get("rt") is not None and not results["rt"].scheduler._faults,
          results.get("rt") is not None and results["rt"].host_range(results["address"]) is None, flush=True)
atexit.register(report)
import torch
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.memory import HostBuffer
from kvtier.runtime import create
rt = create("emulated:split:lazy")
n, row = 8, 256
buffer = HostBuffer.allocate(n * row, "registered", runtime=rt)
view = buffer.as_tensor(torch.uint8).view(n, row)
view.copy_(torch.randint(1, 255, (n, row), dtype=torch.uint8))
dst = DeviceArray.from_tensor(torch.full((n, row), 0x5A, dtype=torch.uint8), runtime=rt)
si = DeviceArray.from_tensor(torch.arange(n), runtime=rt)
io.transfer_kv_per_layer_mla(view, dst, si, si, row)    # queued, never waited for
del view
shm = HostBuffer.allocate(4096, "shm", runtime=rt)
alive = shm.as_tensor()                                 # a view alive at exit
alive.fill_(7)
print("PATH", shm.path, flush=True)
results.update(rt=rt, address=buffer.cpu_address.value)
atexit.register(lambda: print("ATEXIT", int(alive.sum()) == 7 * 4096, flush=True))
"""


def test_ok_interpreter_exit_with_queued_work_and_a_live_view():
    """A process exits with a copy still queued over a viewed registered buffer and an shm buffer whose view is
    alive (and read by an atexit hook). Exit is clean (status 0, nothing on stderr), the live view reads its bytes,
    the queued copy runs without a fault before the registration goes, and the shm file is removed."""
    env, root = child_env()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_CHILD)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines.get("ATEXIT") == "True", done.stdout
    assert lines.get("REPORT") == "True True", done.stdout
    assert not os.path.exists(lines["PATH"])
