"""Pointer tables: device arrays of per-layer base addresses, the only way kernels find a pool's layers.

Built by exactly one function, which resolves every entry through ``get_device_accessible_ptr`` for the table's own
device — a buffer, region or tensor goes in, its device address for that device comes out — so a CPU address cannot
end up in a table, which is the bug the seed had in every pool kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.memory import DeviceAddress, DeviceBuffer, get_device_accessible_ptr
from kvtier.runtime import Runtime


class PointerTable(DeviceBuffer):
    """A device buffer of uint64 addresses; ``entries`` keeps what was written, for the launch boundary's checks."""

    entries: tuple[DeviceAddress, ...]


def build_pointer_table(runtime: Runtime, device: int, operands: Sequence[Any]) -> PointerTable:
    """A table of the device addresses of ``operands`` (HostRegion, DeviceRegion, buffers, tensors, or addresses
    already of ``device``), resolved for ``device``; returns once the table is on the device."""
    if not operands:
        raise InvalidArgument("a pointer table needs at least one entry")
    entries = tuple(get_device_accessible_ptr(operand, device, runtime=runtime) for operand in operands)
    table = PointerTable(8 * len(entries), device, runtime=runtime)
    table.entries = entries
    table.upload(np.array([a.value for a in entries], dtype=np.uint64))
    return table
