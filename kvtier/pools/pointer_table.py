"""Pointer tables: device arrays of per-layer base addresses, the only way kernels find a pool's layers.

Built by exactly one function, from ``DeviceAddress`` values of the table's own device — a CPU address cannot be put
in a table, which is the bug the seed had in every pool kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.errors import AddressDomainError, WrongDeviceError
from kvtier.memory import DeviceAddress, DeviceBuffer
from kvtier.runtime import Runtime


class PointerTable(DeviceBuffer):
    """A device buffer of uint64 addresses; ``entries`` keeps what was written, for checks and debugging."""

    entries: tuple[DeviceAddress, ...]


def build_pointer_table(runtime: Runtime, device: int, addresses: Sequence[DeviceAddress]) -> PointerTable:
    if not addresses:
        raise ValueError("a pointer table needs at least one address")
    for address in addresses:
        if not isinstance(address, DeviceAddress):
            raise AddressDomainError(f"pointer tables hold DeviceAddress values only, got {address!r}")
        if address.device != device:
            raise WrongDeviceError(f"{address} cannot go in a table for device {device}")
    table = PointerTable(8 * len(addresses), device, runtime=runtime)
    table.entries = tuple(addresses)
    table.upload(np.array([a.value for a in addresses], dtype=np.uint64))
    return table
