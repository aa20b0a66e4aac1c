"""Typed addresses keep their domain through arithmetic and refuse to mix."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import AddressDomainError
from kvtier.memory import CpuAddress, DeviceAddress

addresses = st.integers(0, 1 << 56)
offsets = st.integers(0, 1 << 30)


@given(addresses, offsets)
def test_offsets_keep_the_type(value, offset):
    cpu, dev = CpuAddress(value), DeviceAddress(value, 3)
    assert cpu + offset == CpuAddress(value + offset) and (cpu + offset) - cpu == offset
    assert dev + offset == DeviceAddress(value + offset, 3) and (dev + offset) - dev == offset
    assert (dev + offset) - offset == dev


def test_mixing_domains_raises():
    cpu, dev0, dev1 = CpuAddress(4096), DeviceAddress(4096, 0), DeviceAddress(4096, 1)
    for bad in (lambda: cpu + dev0, lambda: dev0 + cpu, lambda: cpu - dev0, lambda: dev0 - cpu, lambda: dev0 - dev1,
                lambda: dev0 < dev1, lambda: dev0 < cpu, lambda: cpu + 1.5, lambda: cpu + True):
        with pytest.raises((AddressDomainError, TypeError)):
            bad()
    assert cpu != dev0 and dev0 != dev1


def test_construction_is_checked():
    for bad in (lambda: CpuAddress(-1), lambda: CpuAddress(1.0), lambda: DeviceAddress(1, -1),
                lambda: DeviceAddress(1, True), lambda: DeviceAddress("1", 0)):
        with pytest.raises(AddressDomainError):
            bad()


def test_addresses_are_not_integers():
    with pytest.raises(TypeError):
        int(CpuAddress(5))
    with pytest.raises(TypeError):
        [0, 1][DeviceAddress(1, 0)]
