"""The seed's bug, reproduced and guarded: registered host memory seen by kernels through the right address."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.device_kernels import random_bytes, xor_copy
from helpers.runtimes import is_split

from kvtier.errors import IllegalAddress
from kvtier.memory import DeviceBuffer, HostBuffer, HostKind, get_device_accessible_ptr
from kvtier.runtime import create

DEVICE_KINDS = [HostKind.REGISTERED, HostKind.PINNED, HostKind.SHM]


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_alias_vs_cpu_address_matches_the_platform(runtime, kind):
    with HostBuffer.allocate(1 << 16, kind, runtime=runtime) as buf:
        alias = get_device_accessible_ptr(buf, 0)
        assert alias.device == 0
        if is_split(runtime):
            assert alias.value != buf.cpu_address.value
        else:
            assert alias.value == buf.cpu_address.value


def test_split_mode_gives_each_device_its_own_alias(two_devices):
    with HostBuffer.allocate(1 << 16, runtime=two_devices) as buf:
        aliases = [get_device_accessible_ptr(buf, d) for d in range(two_devices.device_count())]
        values = {a.value for a in aliases}
        if is_split(two_devices):
            assert len(values) == len(aliases) and buf.cpu_address.value not in values
        assert [a.device for a in aliases] == list(range(two_devices.device_count()))


@pytest.mark.parametrize("offset", [0, 16, 4096 + 48, (1 << 16) - 64])
def test_interior_addresses_keep_their_offset(runtime, offset):
    with HostBuffer.allocate(1 << 16, runtime=runtime) as buf:
        base = get_device_accessible_ptr(buf, 0)
        tensor = buf.as_tensor()[offset:offset + 64]
        assert get_device_accessible_ptr(tensor, 0, runtime=runtime) == base + offset
        assert get_device_accessible_ptr(buf.region(offset, 64), 0) == base + offset
        assert get_device_accessible_ptr(buf.cpu_address + offset, 0, runtime=runtime) == base + offset
        del tensor


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_kernel_reads_and_writes_host_memory_through_the_alias(runtime, kind):
    n = 48 * 1024 + 16
    data, key = random_bytes(n), int(np.random.default_rng().integers(1, 256))
    with HostBuffer.allocate(2 * n, kind, runtime=runtime) as buf:
        view = buf.as_tensor().numpy()
        view[:n] = data
        view[n:] = 0xA5
        for device in range(runtime.device_count()):
            view[n:] = 0xA5
            src, dst = (get_device_accessible_ptr(buf.region(o, n), device) for o in (0, n))
            xor_copy(runtime, dst, src, n, key, device)
            np.testing.assert_array_equal(view[n:], data ^ np.uint8(key))
            np.testing.assert_array_equal(view[:n], data)
        del view


def test_kernel_given_the_cpu_address_faults_in_split_mode(split):
    n = 4096
    with HostBuffer.allocate(2 * n, runtime=split) as buf:
        view = buf.as_tensor().numpy()
        view[:] = random_bytes(2 * n)
        before = view.copy()
        with pytest.raises(IllegalAddress, match="not mapped"):
            xor_copy(split, buf.cpu_address.value + n, buf.cpu_address.value, n, 1, 0)
        np.testing.assert_array_equal(view, before)
        del view
    fresh = create("emulated:split")
    with HostBuffer.allocate(2 * n, runtime=fresh) as buf:
        view = buf.as_tensor().numpy()
        view[:] = before
        xor_copy(fresh, get_device_accessible_ptr(buf.region(n, n), 0), get_device_accessible_ptr(buf.region(0, n), 0),
                 n, 1, 0)
        np.testing.assert_array_equal(view[n:], before[:n] ^ 1)
        del view


def test_kernel_cannot_touch_another_devices_memory(split):
    with DeviceBuffer(4096, 1, runtime=split) as other, DeviceBuffer(4096, 0, runtime=split) as mine:
        with pytest.raises(IllegalAddress, match="device 0"):
            xor_copy(split, mine.address, other.address.value, 4096, 1, 0)


def test_kernel_out_of_range_faults(split):
    with HostBuffer.allocate(4096, runtime=split) as buf:
        alias = get_device_accessible_ptr(buf, 0)
        with pytest.raises(IllegalAddress):
            xor_copy(split, alias, alias, 4096 + 1, 1, 0)


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_memcpy_accepts_both_cpu_address_and_alias(runtime, kind):
    n = 64 * 1024
    with HostBuffer.allocate(n, kind, runtime=runtime) as buf, DeviceBuffer(n, 0, runtime=runtime) as dev:
        data = random_bytes(n)
        view = buf.as_tensor().numpy()
        for host_side in (buf.cpu_address, get_device_accessible_ptr(buf, 0)):
            view[:] = data
            dev.upload(np.full(n, 0x5A, np.uint8))
            runtime.memcpy(dev.address, host_side, n)
            assert dev.download() == data.tobytes()
            view[:] = 0x5A
            runtime.memcpy(host_side, dev.address, n)
            np.testing.assert_array_equal(view, data)
        del view
