"""Arguments of kvtier.memory: numpy integers are taken as the ints they are (sizes, region offsets, devices), also
by the constructors that hand them on to the runtime, and a buffer that cannot be had (an impossible size, an unknown
kind) is refused with a KvtierError that names the choices, never a raw OSError or ValueError. (found
adversarially)"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import InvalidArgument, KvtierError
from kvtier.memory import DeviceBuffer, HostBuffer, get_device_accessible_ptr
from kvtier.pools import DevicePool, KVGeometry
from kvtier.runtime import create


def test_numpy_sized_host_buffer_does_not_break_later_buffers():
    """HostBuffer.allocate(np.int64(n)) succeeds, but in split mode it turns the runtime's alias counter into an
    np.int64, so every *later* registered buffer of that (process-shared) runtime fails to resolve."""
    rt = create("emulated:split")
    with HostBuffer.allocate(np.int64(8192), runtime=rt) as first:
        get_device_accessible_ptr(first, 0)
    with HostBuffer.allocate(8192, runtime=rt) as later:
        get_device_accessible_ptr(later, 0)  # AddressDomainError: DeviceAddress needs a non-negative int, np.int64


@pytest.mark.parametrize("spec", ["emulated:split", "emulated:unified"])
def test_numpy_region_offsets_resolve(spec):
    """region() accepts numpy integers (its checks allow them) but stores them raw: resolving the region, or asking its
    CPU address, then fails with AddressDomainError instead of giving the address."""
    rt = create(spec)
    with HostBuffer.allocate(8192, runtime=rt) as host, DeviceBuffer(8192, 0, runtime=rt) as device:
        host_region = host.region(np.int64(16), np.int64(16))
        assert get_device_accessible_ptr(host_region, 0) == get_device_accessible_ptr(host.region(16, 16), 0)
        assert host_region.cpu_address == host.cpu_address + 16
        assert get_device_accessible_ptr(device.region(np.int64(32), np.int64(16)), 0) == device.address + 32


@pytest.mark.parametrize("make", [
    pytest.param(lambda rt: DeviceBuffer(np.int64(4096), 0, runtime=rt), id="DeviceBuffer-size"),
    pytest.param(lambda rt: DeviceBuffer(4096, np.int64(0), runtime=rt), id="DeviceBuffer-device"),
    pytest.param(lambda rt: DevicePool.allocate(KVGeometry.mha(2, kv_heads=2, head_dim=32, itemsize=2, page_size=4),
                                                np.int64(4), 0, runtime=rt), id="DevicePool-pages"),
    pytest.param(lambda rt: HostBuffer.allocate(np.int64(8192), "pinned", runtime=rt), id="pinned-size"),
])
def test_numpy_sizes_are_accepted_like_ints(make):
    """The shared checks accept numpy integers (HostPool pages=np.int64 works), but these constructors pass the raw
    value on and the runtime refuses it: 'device_alloc: size must be a positive int, got np.int64(4096)' /
    'no device np.int64(0)'."""
    rt = create("emulated:unified")
    make(rt).close()


def test_numpy_device_index_resolves():
    rt = create("emulated:split")
    with HostBuffer.allocate(8192, runtime=rt) as host:
        assert get_device_accessible_ptr(host, np.int64(1)) == get_device_accessible_ptr(host, 1)


@pytest.mark.parametrize("kind", ["registered", "pinned", "shm", "pageable"])
def test_an_impossible_host_buffer_raises_a_kvtier_error(kind, tmp_path, monkeypatch):
    """A buffer the machine cannot map escapes as a raw OSError ('mmap of ... bytes failed' / 'File too large')."""
    monkeypatch.setenv("KVTIER_SHM_DIR", str(tmp_path))
    with pytest.raises(KvtierError):
        HostBuffer.allocate(1 << 60, kind, runtime=create("emulated:split"))


def test_unknown_host_kind_is_an_invalid_argument():
    """HostLayout and PoolKind name the choices with InvalidArgument; HostKind raises a bare ValueError."""
    with pytest.raises(InvalidArgument):
        HostBuffer.allocate(4096, "bogus", runtime=create("emulated:split"))
