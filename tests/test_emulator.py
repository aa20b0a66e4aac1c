"""Emulator semantics other tests lean on: deferred in-order streams, memcpy checks, device memory limits."""

from __future__ import annotations

import numpy as np
import pytest

from device_kernels import random_bytes
from kvtier.errors import IllegalAddress, RuntimeCallError
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime.emulated import EmulatedRuntime


def test_async_work_lands_only_when_synchronized(split):
    n = 4096
    data = random_bytes(n)
    with HostBuffer.allocate(2 * n, HostKind.PINNED, runtime=split) as host, DeviceBuffer(n, 0, runtime=split) as dev:
        view = host.as_tensor().numpy()
        view[:n], view[n:] = data, 0x11
        stream = split.create_stream(0)
        split.memcpy_async(dev.address.value, host.cpu_address.value, n, stream=stream)
        split.memcpy_async(host.cpu_address.value + n, dev.address.value, n, stream=stream)
        assert (view[n:] == 0x11).all(), "work ran before anyone waited for it"
        split.synchronize(0)
        np.testing.assert_array_equal(view[n:], data)
        del view


def test_kernel_fault_surfaces_at_synchronize_and_clears_the_queue(split):
    with HostBuffer.allocate(4096, runtime=split) as buf:
        split.launch_python(lambda mem, a: mem.view(a, 16), buf.cpu_address.value, device=0)
        with pytest.raises(IllegalAddress):
            split.synchronize(0)
        split.synchronize(0)


def test_memcpy_refuses_unmapped_emulated_addresses(split):
    dev = DeviceBuffer(4096, 0, runtime=split)
    address = dev.address.value
    dev.close()
    scratch = np.zeros(4096, np.uint8)
    with pytest.raises(RuntimeCallError, match="not mapped"):
        split.memcpy(scratch.ctypes.data, address, 4096)
    with HostBuffer.allocate(4096, runtime=split) as buf, pytest.raises(RuntimeCallError, match="runs past"):
        split.memcpy(scratch.ctypes.data, buf.cpu_address.value, 8192)


def test_device_memory_is_bounded():
    rt = EmulatedRuntime("split", device_memory_bytes=1 << 20)
    with DeviceBuffer(1 << 20, 0, runtime=rt), pytest.raises(RuntimeCallError, match="cudaErrorMemoryAllocation"):
        DeviceBuffer(1, 0, runtime=rt)


def test_streams_belong_to_their_device(split):
    stream = split.create_stream(1)
    with pytest.raises(IllegalAddress, match="stream of device 1"):
        split.launch_python(lambda mem: None, device=0, stream=stream)
