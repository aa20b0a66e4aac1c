"""HostBuffer kinds, torch views, lifetime rules; offsets that are not integers are refused."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers.compat import byte_operands
from helpers.device_kernels import random_bytes
from helpers.operands import POISON, no_automatic_collection
from helpers.paths import child_env

from kvtier.compat.sglang import kvcacheio
from kvtier.errors import BufferClosed, BufferInUse, HugePagesUnavailable, InvalidArgument, KvtierError
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind, get_device_accessible_ptr
from kvtier.runtime import create


@pytest.mark.parametrize("kind", [HostKind.PINNED, HostKind.REGISTERED, HostKind.SHM, HostKind.PAGEABLE])
def test_every_kind_holds_its_bytes(runtime, kind):
    n = 3 * 4096 + 512
    data = random_bytes(n)
    with HostBuffer.allocate(n, kind, runtime=runtime) as buf:
        tensor = buf.as_tensor()
        assert tensor.numel() == n and tensor.data_ptr() == buf.cpu_address.value
        tensor.numpy()[:] = data
        np.testing.assert_array_equal(buf.as_tensor().numpy(), data)
        assert buf.device_accessible == (kind is not HostKind.PAGEABLE)
        if runtime.name == "cuda":
            assert tensor.is_pinned() == buf.device_accessible
        del tensor


def test_registered_buffers_record_their_chunks(runtime):
    with HostBuffer.allocate(1 << 20, runtime=runtime, register_chunk_bytes=256 << 10) as buf:
        assert [size for _, size in buf.chunks] == [256 << 10] * 4
        assert [start - buf.cpu_address for start, _ in buf.chunks] == [0, 256 << 10, 512 << 10, 768 << 10]
        assert buf.register_seconds >= 0
    assert all(runtime.host_range(start.value) is None for start, _ in buf.chunks)


def test_typed_views(runtime):
    import torch

    with HostBuffer.allocate(4096, runtime=runtime) as buf:
        halves = buf.as_tensor(torch.bfloat16)
        assert halves.numel() == 2048 and halves.dtype == torch.bfloat16
        del halves
    with HostBuffer.allocate(4098, runtime=runtime) as odd, pytest.raises(KvtierError, match="whole number"):
        odd.as_tensor(torch.float32)


def test_close_refuses_while_views_live_and_is_idempotent(runtime):
    buf = HostBuffer.allocate(1 << 16, runtime=runtime)
    view = buf.as_tensor()[100:200]
    with pytest.raises(BufferInUse, match="1 tensor view"):
        buf.close()
    assert not buf.closed and runtime.host_range(buf.cpu_address.value) is not None
    view.fill_(7)
    del view
    start = buf.cpu_address.value
    buf.close()
    buf.close()
    assert buf.closed and runtime.host_range(start) is None
    with pytest.raises(BufferClosed):
        _ = buf.cpu_address
    with pytest.raises(BufferClosed):
        get_device_accessible_ptr(buf, 0)


def test_close_collects_views_that_only_a_reference_cycle_holds(runtime):
    """A view caught in a traceback's frames (``pytest.raises``, ``except ... as e``) is garbage, not a user: close
    must not be refused until the collector happens to run."""
    import gc

    buf = HostBuffer.allocate(1 << 16, runtime=runtime)
    gc.disable()
    try:
        cycle: list = [buf.as_tensor()[10:20]]
        cycle.append(cycle)
        del cycle
        assert buf.live_views() == 1
        buf.close()
    finally:
        gc.enable()
    assert buf.closed


def test_collected_buffer_unregisters(runtime):
    buf = HostBuffer.allocate(1 << 16, runtime=runtime)
    start = buf.cpu_address.value
    del buf
    import gc

    gc.collect()
    assert runtime.host_range(start) is None


def test_hugetlb_works_or_names_the_sysctl(runtime):
    try:
        buf = HostBuffer.allocate(2 << 20, HostKind.HUGETLB, runtime=runtime)
    except HugePagesUnavailable as exc:
        assert "vm.nr_hugepages" in str(exc)
        return
    with buf:
        data = random_bytes(2 << 20)
        view = buf.as_tensor().numpy()
        view[:] = data
        assert get_device_accessible_ptr(buf, 0).device == 0
        np.testing.assert_array_equal(view, data)
        del view


def test_bad_sizes_and_names(runtime):
    for size in (0, -1, 1.5, True):
        with pytest.raises(KvtierError):
            HostBuffer.allocate(size, runtime=runtime)
    with pytest.raises(KvtierError, match="only shm"):
        HostBuffer.allocate(4096, HostKind.REGISTERED, runtime=runtime, name="x")
    with pytest.raises(KvtierError, match="letters"):
        HostBuffer.allocate(4096, HostKind.SHM, runtime=runtime, name="../etc/passwd")
    with pytest.raises(ValueError):
        HostBuffer.allocate(4096, "file", runtime=runtime)


def test_region_bounds(runtime):
    with HostBuffer.allocate(8192, runtime=runtime) as buf:
        assert buf.region(4096, 4096).cpu_address == buf.cpu_address + 4096
        with pytest.raises(KvtierError):
            buf.region(4096, 4097)
        with pytest.raises(KvtierError):
            get_device_accessible_ptr(buf.region(8192, 1), 0)


def test_bools_and_floats_are_not_offsets(runtime):
    with HostBuffer.allocate(8192, runtime=runtime) as buf, DeviceBuffer(4096, 0, runtime=runtime) as dev:
        for offset in (True, 1.0, "16"):
            with pytest.raises(InvalidArgument, match="offset must be an integer"):
                buf.region(offset, 16)
            with pytest.raises(InvalidArgument, match="offset must be an integer"):
                dev.upload(b"\x01" * 16, offset)
        with pytest.raises(KvtierError):
            buf.cpu_address + True
_FORK_CHILD = """
import gc, os, sys, torch
from kvtier.compat import DeviceArray
from kvtier.compat.sglang import kvcacheio as io
from kvtier.memory import HostBuffer
from kvtier.runtime import create
rt = create("emulated:split")
n, row = 8, 256
buffers = {kind: HostBuffer.allocate(n * row, kind, runtime=rt) for kind in ("registered", "shm", "pinned")}
data = {}
for kind, buffer in buffers.items():
    view = buffer.as_tensor(torch.uint8).view(n, row)
    view.copy_(torch.randint(1, 255, (n, row), dtype=torch.uint8))
    data[kind] = view.clone()
    del view
pid = os.fork()
if pid == 0:
    for buffer in buffers.values():
        buffer.close()                     # the child's copies: marked closed, nothing given back
    del buffers
    gc.collect()
    sys.exit(0)                            # normal exit: atexit and finalizers run in the child
_, status = os.waitpid(pid, 0)
ok = [os.waitstatus_to_exitcode(status) == 0, os.path.exists(buffers["shm"].path)]
si = DeviceArray.from_tensor(torch.arange(n), runtime=rt)
for kind, buffer in buffers.items():
    ok.append(rt.host_range(buffer.cpu_address.value) is not None)
    dst = DeviceArray.from_tensor(torch.full((n, row), 0x5A, dtype=torch.uint8), runtime=rt)
    view = buffer.as_tensor(torch.uint8).view(n, row)
    io.transfer_kv_per_layer_mla(view, dst, si, si, row)
    rt.synchronize(0)
    ok.append(bool(torch.equal(dst.cpu(), data[kind])))
    del view
    buffer.close()
print("FORK", all(ok), ok)
"""


def test_ok_a_fork_child_closing_and_exiting_leaves_the_parents_buffers_alone():
    """A fork child closes its copies of the parent's registered, shm and pinned buffers (all viewed) and exits
    normally: the parent's registrations, the shm file and every byte are intact, and kernels read them after."""
    env, root = child_env()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_FORK_CHILD)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FORK True" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("mode", ["emulated:split:2:lazy", "emulated:unified:2:lazy"])
def test_closing_a_registered_host_buffer_does_not_unmap_it_under_a_queued_compat_copy(mode):
    """A compat call queues a kernel writing into a view of a 'registered' HostBuffer (kvtier's default kind); the
    caller drops its view and closes the buffer. close() waits for its engine users, but the compat call never
    registered as one, so close() unregisters the memory at once and the still-queued kernel faults
    (IllegalAddress: 'not mapped on this device'; the device is poisoned). A 'pinned' buffer is fine only because
    cudaFreeHost drains the device. Expected: close() waits for the queued compat work (or refuses with
    BufferInUse); the device never faults. (found adversarially, issue #15)"""
    runtime = create(mode)
    m = byte_operands(runtime)
    tokens, item = 8, 16
    src = m.device((tokens, item))
    buffer = HostBuffer.allocate(tokens * item, HostKind.REGISTERED, runtime=runtime)
    view = buffer.as_tensor(torch.uint8).view(tokens, item)
    view.fill_(POISON)
    kvcacheio.transfer_kv_per_layer_mla(src, view, m.indices(list(range(tokens))), m.indices(list(range(tokens))), item)
    del view
    gc.collect()
    with contextlib.suppress(BufferInUse):
        buffer.close()
    runtime.synchronize(0)          # faults: the kernel ran on memory close() had already unregistered


def test_close_collects_the_garbage_holding_views_before_it_takes_the_buffers_lock(split):
    """The collection close() runs to free views only garbage holds runs finalizers, which take other locks (a
    buffer's release takes the runtime's). Run under the buffer's lock, it ordered the host_buffer lock before the
    runtime's, while a finalizer closing a buffer inside an emulated kernel takes them the other way round: the
    lock-order mode found the cycle (docs/lifetime.md)."""
    buffer = HostBuffer.allocate(1 << 16, runtime=split)
    held = []

    class Garbage:
        def __del__(self):
            held.append(buffer._lock._is_owned())

    with no_automatic_collection():
        garbage = Garbage()
        garbage.me, garbage.view = garbage, buffer.as_tensor()
        del garbage
        buffer.close()
    assert buffer.closed
    assert held == [False], "the collection ran under the buffer's lock"
