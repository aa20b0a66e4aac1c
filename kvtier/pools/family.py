"""What every model-family pool (Mamba state, DSA indexer, DeepSeek-V4 page rows) is to the transfer engine: *parts*.

A part is one array of a pool — a state tensor (conv, temporal), the page rows of an indexer, one region of a page row
(the 576-byte values, the 8-byte scales) — seen per layer as units (request slots, pages or tokens), each unit an item
of ``pieces`` contiguous chunks of ``chunk_bytes``. Each side places a part with per-layer bases and strides
(:class:`Placement`); the engine turns a (part, device placement, host placement) triple into one kernel launch per
layer span. Families differ only in how they derive parts and placements, so none of them takes addresses any other
way: device bases go through the one resolver, host bases are regions of the host buffer, and pointer tables are built
by ``build_pointer_table``.

:class:`FamilyDevicePool` and :class:`FamilyHostPool` hold what all families share: per-part operands, lifetime
(close waits for the engines queued over the pool) and index checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.checks import integer
from kvtier.errors import InvalidArgument
from kvtier.memory import DeviceAddress, DeviceBuffer, DeviceRegion, HostBuffer, HostKind, get_device_accessible_ptr
from kvtier.pools.device_pool import DevicePoolLifetime, check_range
from kvtier.pools.host_pool import HostPoolLifetime
from kvtier.runtime import Runtime

UNITS = ("slot", "page", "token")


@dataclass(frozen=True)
class Part:
    """One array of a family pool, as a transfer walks it: ``layers`` are the model layers that have it."""

    name: str
    layers: tuple[int, ...]
    unit: str
    chunk_bytes: int
    pieces: int = 1
    units_per_page: int = 1

    @property
    def item_bytes(self) -> int:
        return self.chunk_bytes * self.pieces


@dataclass(frozen=True)
class Placement:
    """Where one side keeps a part: a base per layer of the part (operands the resolver understands: buffers,
    regions, tensors, device addresses), and the byte strides of a page, of a unit within a page, and of a piece."""

    bases: tuple[Any, ...]
    page_stride: int
    unit_stride: int = 0
    piece_stride: int = 0


def item_pieces(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple[int, int, int]:
    """(chunk bytes, pieces, piece stride) of one unit's item with element ``strides`` (in elements) — a contiguous
    item is one chunk; an item whose rows are padded (a strided view) is rows of equal chunks. Anything irregular is
    refused: the kernel walks items as evenly spaced chunks."""
    dims = [(int(n), int(s) * itemsize) for n, s in zip(shape, strides, strict=True) if int(n) != 1]
    chunk, i = itemsize, len(dims)
    while i and dims[i - 1][1] == chunk:
        chunk *= dims[i - 1][0]
        i -= 1
    if i == 0:
        return chunk, 1, chunk
    outer = dims[:i]
    pieces, stride = outer[-1]
    for n, s in reversed(outer[:-1]):
        if s != stride * pieces:
            raise InvalidArgument(f"an item of shape {tuple(shape)} and strides {tuple(strides)} is not evenly spaced "
                                  f"chunks: make its inner dimensions contiguous")
        pieces *= n
    return chunk, pieces, stride


class FamilyDevicePool(DevicePoolLifetime):
    """Device arrays of a family pool: per part, a base per layer and a placement. Engines own their tensors; a pool
    made from tensors holds them until it is closed, so torch cannot hand their memory to others meanwhile."""

    def __init__(self, geometry: Any, units: int, device: int, runtime: Runtime,
                 parts: dict[str, tuple[Part, Placement]], keep: Sequence[Any] = (),
                 owned: Sequence[DeviceBuffer] = (), operands: Sequence[Any] | None = None) -> None:
        """``operands``: what the bases were made from, when they are addresses (to notice a buffer closed by
        someone else); by default the bases themselves."""
        self.geometry, self.units, self.device, self.runtime = geometry, units, device, runtime
        self._parts = {name: (part, Placement(tuple(get_device_accessible_ptr(op, device, runtime=runtime)
                                                    for op in placement.bases), placement.page_stride,
                                              placement.unit_stride, placement.piece_stride))
                       for name, (part, placement) in parts.items()}
        if operands is None:
            operands = [op for _, placement in parts.values() for op in placement.bases]
        self._track(operands, owned, keep)

    def parts(self) -> list[tuple[Part, Placement]]:
        """Every part with its device placement (bases resolved for the pool's device at construction)."""
        self.check_open()
        return list(self._parts.values())

    def part(self, name: str) -> tuple[Part, Placement]:
        self.check_open()
        if name not in self._parts:
            raise InvalidArgument(f"this pool has no part {name!r} (parts: {', '.join(self._parts)})")
        return self._parts[name]

    def check_units(self, units: np.ndarray, what: str) -> None:
        check_range(units, self.units, what)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.units} units"
        return f"<{type(self).__name__} {self.geometry.name} {state} on device {self.device} of {self.runtime.name}>"


def allocate_parts(sizes: dict[str, list[int]], device: int, runtime: Runtime
                   ) -> tuple[dict[str, list[DeviceBuffer]], list[DeviceBuffer]]:
    """Device buffers per part and layer (``sizes[name][i]`` bytes), all freed again if one allocation fails."""
    made: dict[str, list[DeviceBuffer]] = {}
    owned: list[DeviceBuffer] = []
    try:
        for name, layer_sizes in sizes.items():
            made[name] = []
            for nbytes in layer_sizes:
                buffer = DeviceBuffer(nbytes, device, runtime=runtime)
                owned.append(buffer)
                made[name].append(buffer)
    except BaseException:
        for buffer in owned:
            buffer.close()
        raise
    return made, owned


class FamilyHostPool(HostPoolLifetime):
    """A family pool's host copy: one HostBuffer, every unit's items of every layer at offsets a layout decides.

    ``offsets[name]`` maps a part to (base of layer position i, page stride, unit stride): layout functions of each
    family fill it. The host side keeps a part's item contiguous (piece stride = chunk size)."""

    def __init__(self, geometry: Any, layout: str, units: int, buffer: HostBuffer,
                 offsets: dict[str, tuple[list[int], int, int]]) -> None:
        self.geometry, self.layout, self.units, self.buffer = geometry, layout, units, buffer
        self.offsets = offsets

    @staticmethod
    def make_buffer(nbytes: int, kind: HostKind | str, runtime: Runtime | None, register_chunk_bytes: int,
                    granularity: int, name: str | None) -> HostBuffer:
        return HostBuffer.allocate(nbytes, kind, runtime=runtime, granularity=granularity,
                                   register_chunk_bytes=register_chunk_bytes, name=name)

    @property
    def runtime(self) -> Runtime:
        return self.buffer.runtime

    def placement(self, part: Part) -> Placement:
        """The host placement of ``part``: regions from each layer's base to the end of the buffer (everything a
        kernel walking that layer may touch), resolved by whoever builds the pointer table."""
        if part.name not in self.offsets:
            raise InvalidArgument(f"this host pool has no part {part.name!r}")
        bases, page_stride, unit_stride = self.offsets[part.name]
        regions = tuple(self.buffer.region(b, self.buffer.nbytes - b) for b in bases)
        return Placement(regions, page_stride, unit_stride, part.chunk_bytes)

    def cpu_offsets(self, part: Part) -> tuple[list[int], int, int]:
        """CPU-side view of the same placement (buffer offsets), for copy engines and storage."""
        return self.offsets[part.name]

    def check_units(self, units: np.ndarray, what: str) -> None:
        check_range(units, self.units, what)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.geometry.name} {self.layout} {self.units} units, {self.buffer!r}>"


def host_units(pages: Any, slots: Any, nbytes: Any, unit_bytes: int, what: str) -> int:
    """Size a host pool by exactly one of a unit count or a byte budget."""
    given = {k: v for k, v in ((what, pages if pages is not None else slots), ("nbytes", nbytes)) if v is not None}
    if len(given) != 1:
        raise InvalidArgument(f"size a host pool by exactly one of {what}= or nbytes=")
    (name, value), = given.items()
    value = integer(value, name, low=1)
    count = value if name != "nbytes" else value // unit_bytes
    if count < 1:
        raise InvalidArgument(f"a host pool needs at least one unit ({unit_bytes} bytes each)")
    return count


def region_of(base: Any, offset: int, nbytes: int) -> Any:
    """A device operand ``offset`` bytes into ``base`` (a region when ``base`` is a buffer, else an address)."""
    if isinstance(base, DeviceBuffer):
        return base.region(offset, nbytes)
    if isinstance(base, DeviceRegion):
        return base.buffer.region(base.offset + offset, nbytes)
    if isinstance(base, DeviceAddress):
        return base + offset
    raise InvalidArgument(f"cannot take an offset into {type(base).__name__}")

