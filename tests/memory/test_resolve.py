"""get_device_accessible_ptr: the target device's address, the caller's device untouched, bad memory refused; a
strided tensor is measured by its whole extent, not by numel * itemsize."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.runtimes import is_split

from kvtier.errors import (
    AddressDomainError,
    InvalidDevice,
    KvtierError,
    NotDeviceAccessible,
    RegistrationError,
    WrongDeviceError,
    WrongRuntime,
)
from kvtier.memory import (
    CpuAddress,
    DeviceAddress,
    DeviceBuffer,
    HostBuffer,
    HostKind,
    get_device_accessible_ptr,
    tensor_extent,
)
from kvtier.runtime import create


def _bytes_at(address, nbytes):
    import ctypes

    return (ctypes.c_uint8 * nbytes).from_address(address)


def test_current_device_is_preserved(two_devices):
    rt = two_devices
    with HostBuffer.allocate(1 << 16, runtime=rt) as buf:
        rt.set_device(1)
        try:
            alias = get_device_accessible_ptr(buf, 0)
            assert alias.device == 0
            assert rt.current_device() == 1
            assert get_device_accessible_ptr(buf.cpu_address + 64, 0, runtime=rt) == alias + 64
            assert rt.current_device() == 1
        finally:
            rt.set_device(0)


def test_current_device_is_preserved_when_resolving_raises(two_devices):
    rt = two_devices
    with DeviceBuffer(4096, 0, runtime=rt) as dev0, HostBuffer.allocate(4096, HostKind.PAGEABLE, runtime=rt) as page:
        rt.set_device(1)
        try:
            with pytest.raises(WrongDeviceError):
                get_device_accessible_ptr(dev0, 1)
            assert rt.current_device() == 1
            with pytest.raises(NotDeviceAccessible):
                get_device_accessible_ptr(page.cpu_address, 0, runtime=rt)
            assert rt.current_device() == 1
            with pytest.raises(InvalidDevice):
                get_device_accessible_ptr(page, 99)
            assert rt.current_device() == 1
        finally:
            rt.set_device(0)


def test_using_device_restores_after_an_exception(two_devices):
    rt = two_devices
    rt.set_device(1)
    try:
        with pytest.raises(RuntimeError, match="boom"), rt.using_device(0):
            assert rt.current_device() == 0
            raise RuntimeError("boom")
        assert rt.current_device() == 1
    finally:
        rt.set_device(0)


def test_device_memory_resolves_on_its_own_device_only(two_devices):
    rt = two_devices
    with DeviceBuffer(4096, 1, runtime=rt) as dev1:
        assert get_device_accessible_ptr(dev1, 1) == dev1.address
        assert get_device_accessible_ptr(dev1.address + 128, 1, runtime=rt) == dev1.address + 128
        with pytest.raises(WrongDeviceError, match="device 1.*device 0"):
            get_device_accessible_ptr(dev1, 0)
        with pytest.raises(WrongDeviceError):
            get_device_accessible_ptr(dev1.address, 0, runtime=rt)


def test_pageable_memory_is_refused(runtime):
    if runtime.device_attributes(0).pageable_memory_access:
        pytest.skip("this device can access pageable memory")
    with HostBuffer.allocate(1 << 16, HostKind.PAGEABLE, runtime=runtime) as buf:
        with pytest.raises(NotDeviceAccessible, match="pageable"):
            get_device_accessible_ptr(buf, 0)
        view = buf.as_tensor()
        with pytest.raises(NotDeviceAccessible, match="pageable"):
            get_device_accessible_ptr(view, 0, runtime=runtime)
        del view
    plain = torch.arange(1000, dtype=torch.int32)
    with pytest.raises(NotDeviceAccessible):
        get_device_accessible_ptr(plain, 0, runtime=runtime)
    array = np.ones(4096, np.uint8)
    with pytest.raises(NotDeviceAccessible):
        get_device_accessible_ptr(CpuAddress(array.ctypes.data), 0, runtime=runtime)


def test_raw_integers_are_refused(runtime):
    with HostBuffer.allocate(4096, runtime=runtime) as buf:
        with pytest.raises(AddressDomainError, match="raw integer"):
            get_device_accessible_ptr(buf.cpu_address.value, 0, runtime=runtime)


def test_unknown_device_is_refused(runtime):
    with HostBuffer.allocate(4096, runtime=runtime) as buf:
        with pytest.raises(InvalidDevice):
            get_device_accessible_ptr(buf, runtime.device_count())
        with pytest.raises(InvalidDevice):
            get_device_accessible_ptr(buf, -1)


def test_device_spellings(runtime):
    with HostBuffer.allocate(4096, runtime=runtime) as buf:
        expected = get_device_accessible_ptr(buf, 0)
        assert get_device_accessible_ptr(buf, "cuda:0") == expected
        assert get_device_accessible_ptr(buf, torch.device("cuda", 0)) == expected


def test_tensor_over_two_registrations_needs_contiguous_aliases(runtime):
    with HostBuffer.allocate(8192, runtime=runtime, granularity=4096, register_chunk_bytes=4096) as buf:
        whole = buf.as_tensor()
        if is_split(runtime):
            with pytest.raises(RegistrationError, match="not contiguous"):
                get_device_accessible_ptr(whole, 0, runtime=runtime)
        else:
            assert get_device_accessible_ptr(whole, 0, runtime=runtime) == get_device_accessible_ptr(buf, 0)
        assert get_device_accessible_ptr(whole[4096:], 0, runtime=runtime) == get_device_accessible_ptr(
            buf.region(4096, 4096), 0)
        del whole


def test_span_past_the_buffer_end_is_refused(runtime):
    with HostBuffer.allocate(8192, runtime=runtime) as buf:
        with pytest.raises(RegistrationError, match="runs past"):
            get_device_accessible_ptr(torch.frombuffer(_bytes_at(buf.cpu_address.value + 4096, 8192),
                                                       dtype=torch.uint8), 0, runtime=runtime)


@pytest.mark.gpu
def test_torch_tensors_on_cuda(cuda):
    runtime = cuda
    on_device = torch.randint(1, 255, (4096,), dtype=torch.uint8, device="cuda:0")
    assert get_device_accessible_ptr(on_device[16:], 0, runtime=runtime) == DeviceAddress(on_device.data_ptr() + 16, 0)
    pinned = torch.empty(4096, dtype=torch.uint8).pin_memory()
    alias = get_device_accessible_ptr(pinned[64:], 0, runtime=runtime)
    assert alias.value == runtime.host_get_device_pointer(pinned.data_ptr() + 64, 0)


def test_tensor_extent_follows_strides():
    base = torch.zeros(4, 1024, dtype=torch.int32)
    assert tensor_extent(base) == (0, 4 * 1024 * 4)
    assert tensor_extent(base[:, :4]) == (0, 3 * 4096 + 16)
    assert tensor_extent(base.t()) == (0, 4 * 1024 * 4)
    assert tensor_extent(base[0:1, 0:1].expand(8, 8)) == (0, 4)
    assert tensor_extent(base[:0]) == (0, 0)


def test_strided_rows_across_a_registration_chunk(runtime):
    """Rows 4096 bytes apart, 16 bytes each: the old numel*itemsize measure saw 32 bytes inside chunk 0."""
    with HostBuffer.allocate(8192, runtime=runtime, granularity=4096, register_chunk_bytes=4096) as buf:
        rows = buf.as_tensor().view(2, 4096)[:, :16]
        if is_split(runtime):
            with pytest.raises(RegistrationError, match="not contiguous"):
                get_device_accessible_ptr(rows, 0, runtime=runtime)
        else:
            assert get_device_accessible_ptr(rows, 0, runtime=runtime) == get_device_accessible_ptr(buf, 0)
        del rows


def test_strided_view_past_the_buffer_end_is_refused(runtime):
    """Two 16-byte rows 8 KiB apart from the start of an 8 KiB buffer: 32 bytes by numel, 8208 by extent."""
    import ctypes

    with HostBuffer.allocate(8192, runtime=runtime) as buf:
        wider = torch.frombuffer((ctypes.c_uint8 * 16384).from_address(buf.cpu_address.value), dtype=torch.uint8)
        past = wider.view(2, 8192)[:, :16]
        with pytest.raises(RegistrationError, match="runs past"):
            get_device_accessible_ptr(past, 0, runtime=runtime)
        inside = wider.view(4, 4096)[:2, :16]
        assert get_device_accessible_ptr(inside, 0, runtime=runtime) == get_device_accessible_ptr(buf, 0)
        del wider, past, inside


def test_buffer_of_another_runtime_is_a_wrong_runtime_error():
    """The message reads 'buffer belongs to <EmulatedRuntime emulated:split>, not <EmulatedRuntime emulated:split>'
    (a plain KvtierError); streams and events of another runtime raise WrongRuntime. (found adversarially)"""
    owner, other = create("emulated:split"), create("emulated:split")
    with HostBuffer.allocate(4096, runtime=owner) as host:
        with pytest.raises(WrongRuntime):
            get_device_accessible_ptr(host, 0, runtime=other)


def test_empty_view_of_a_registered_buffer_is_not_called_pageable():
    """An empty slice of a registered buffer is refused as '0x0 is pageable host memory'. (found adversarially)"""
    rt = create("emulated:split")
    with HostBuffer.allocate(8192, runtime=rt) as host:
        view = host.as_tensor()[100:100]
        try:
            get_device_accessible_ptr(view, 0, runtime=rt)
        except KvtierError as exc:
            assert "pageable" not in str(exc)
        finally:
            del view
