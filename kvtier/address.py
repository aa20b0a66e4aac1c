"""Typed addresses: a CPU address and a device address that knows its device.

A leaf module: the runtime's copy and launch APIs take these types, and every layer above hands them down.

Registered host memory has two addresses that are equal on some machines and different on others; code that keeps
them as bare integers works on the first kind and faults on the second. These types make the domain part of the
value: offsets keep the type, subtracting two addresses of one domain gives a byte count, and mixing domains (or
devices) raises instead of producing a plausible integer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

from kvtier.errors import AddressDomainError

Address = Union["CpuAddress", "DeviceAddress"]


def _offset(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AddressDomainError(f"{what} takes an integer byte offset, not {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True, order=True)
class CpuAddress:
    """An address the CPU dereferences: storage backends, metadata, unregistering."""

    value: int

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, int) or self.value < 0:
            raise AddressDomainError(f"CpuAddress needs a non-negative int, got {self.value!r}")

    def __add__(self, offset: int) -> CpuAddress:
        return CpuAddress(self.value + _offset(offset, "CpuAddress +"))

    def __sub__(self, other: Union[int, "CpuAddress"]) -> Union["CpuAddress", int]:
        if isinstance(other, CpuAddress):
            return self.value - other.value
        if isinstance(other, DeviceAddress):
            raise AddressDomainError(f"cannot subtract {other} from {self}: different address domains")
        return CpuAddress(self.value - _offset(other, "CpuAddress -"))

    def aligned(self, alignment: int) -> bool:
        return self.value % alignment == 0

    def __repr__(self) -> str:
        return f"CpuAddress(0x{self.value:x})"


@functools.total_ordering
@dataclass(frozen=True)
class DeviceAddress:
    """An address valid for kernels on ``device`` (device memory, or the alias of registered host memory)."""

    value: int
    device: int

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, int) or self.value < 0:
            raise AddressDomainError(f"DeviceAddress needs a non-negative int, got {self.value!r}")
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < 0:
            raise AddressDomainError(f"DeviceAddress needs a device index, got {self.device!r}")

    def __add__(self, offset: int) -> DeviceAddress:
        return DeviceAddress(self.value + _offset(offset, "DeviceAddress +"), self.device)

    def __sub__(self, other: Union[int, "DeviceAddress"]) -> Union["DeviceAddress", int]:
        if isinstance(other, DeviceAddress):
            if other.device != self.device:
                raise AddressDomainError(f"cannot subtract {other} from {self}: different devices")
            return self.value - other.value
        if isinstance(other, CpuAddress):
            raise AddressDomainError(f"cannot subtract {other} from {self}: different address domains")
        return DeviceAddress(self.value - _offset(other, "DeviceAddress -"), self.device)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, DeviceAddress) or other.device != self.device:
            raise AddressDomainError(f"cannot order {self} against {other!r}")
        return self.value < other.value

    def aligned(self, alignment: int) -> bool:
        return self.value % alignment == 0

    def __repr__(self) -> str:
        return f"DeviceAddress(0x{self.value:x}, device={self.device})"
