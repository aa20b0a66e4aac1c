"""How a copy between a device pool and a host pool splits into chunks: the coarsest run contiguous on both sides.

- each (page, layer) piece contiguous on the host (``layer_first``, ``page_first_direct``, and ``page_head`` with one
  head): one chunk per page and layer;
- only token rows contiguous (``page_first``): one chunk per token row;
- only head pieces contiguous (``page_head`` with several heads): one chunk per token and head.
The same plan drives the kernel (as chunk sides) and the DMA backends (as byte offsets of runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import InvalidArgument
from kvtier.kernels import ChunkSide
from kvtier.pools.geometry import KVGeometry, Strides, device_strides

GROUP_RUN_BYTES = 4096


@dataclass(frozen=True)
class ChunkPlan:
    geometry: KVGeometry
    host: Strides
    unit: str
    chunk_bytes: int
    pieces: int

    @property
    def unit_major(self) -> bool:
        """Whether a unit's layers lie closer together on the host than its units (``page_first``,
        ``page_first_direct``): then a many-layer copy walks unit by unit and moves contiguous host runs."""
        unit_stride = self.host.page if self.unit == "page" else self.host.slot
        return 0 < self.host.layer < unit_stride

    def signal_group(self) -> int:
        """Layers a per-layer load walks together where the host keeps a unit's layers adjacent (``page_first``):
        enough for ~4 KiB host runs (a 2 KiB Llama row: 2 layers, a 1152-byte MLA row: 4, a 64-byte row: 64), at
        most a quarter of the layers, so the first layers still land early. 1 elsewhere (the layer-major walk)."""
        if not self.unit_major:
            return 1
        return max(1, min(-(-GROUP_RUN_BYTES // self.chunk_bytes), self.geometry.layers // 4))

    @property
    def units_per_page(self) -> int:
        return 1 if self.unit == "page" else self.geometry.page_size

    def units(self, pages: np.ndarray) -> np.ndarray:
        """Page indices → the unit indices the kernel walks (pages, or tokens page * page_size + slot)."""
        if self.unit == "page":
            return pages.astype(np.int64, copy=False)
        size = self.geometry.page_size
        return (pages.astype(np.int64)[:, None] * size + np.arange(size, dtype=np.int64)[None, :]).reshape(-1)

    def side(self, table: Any, strides: Strides) -> ChunkSide:
        if self.unit == "page":
            return ChunkSide(table, strides.page, 0, 0, 1)
        piece = strides.head if self.unit == "head" else 0
        return ChunkSide(table, strides.page, strides.slot, piece, self.geometry.page_size)

    def device_side(self, table: Any) -> ChunkSide:
        return self.side(table, device_strides(self.geometry))

    def host_side(self, table: Any) -> ChunkSide:
        return self.side(table, self.host)

    def offsets(self, pages: np.ndarray, strides: Strides) -> np.ndarray:
        """Byte offset from a layer's base of every chunk, in kernel order (unit-major, piece-minor)."""
        units = self.units(pages)
        page, slot = np.divmod(units, self.units_per_page)
        base = page * strides.page + (slot * strides.slot if self.unit != "page" else 0)
        if self.pieces == 1:
            return base
        return (base[:, None] + np.arange(self.pieces, dtype=np.int64)[None, :] * strides.head).reshape(-1)


def plan_for(geometry: KVGeometry, host: Strides) -> ChunkPlan:
    g = geometry
    if host.page_piece_contiguous(g):
        return ChunkPlan(g, host, "page", g.page_bytes, 1)
    if host.row_contiguous(g):
        return ChunkPlan(g, host, "token", g.row_bytes, 1)
    return ChunkPlan(g, host, "head", g.head_bytes, g.heads)


def index_values(units: np.ndarray, index_bytes: int) -> np.ndarray:
    """Unit indices in the kernel's index type; int32 refuses what it cannot hold instead of wrapping."""
    if index_bytes == 8:
        return np.ascontiguousarray(units, dtype=np.int64)   # a strided view cannot be uploaded as bytes
    if units.size and int(units.max()) >= 1 << 31:
        raise InvalidArgument(f"unit index {int(units.max())} does not fit int32 indices (index_bytes=4): use "
                              f"index_bytes=8")
    return units.astype(np.int32)


def merge_runs(src: np.ndarray, dst: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge chunks that continue the previous one on both sides into runs: (src offsets, dst offsets, sizes)."""
    if src.size == 0:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != size) | (np.diff(dst) != size)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths * size


def layer_spans(layers: Sequence[int], per_layer: bool) -> list[tuple[int, int]]:
    """Per-layer operations take one layer at a time; the others take each run of consecutive layers at once."""
    spans: list[tuple[int, int]] = []
    for layer in layers:
        if not per_layer and spans and spans[-1][0] + spans[-1][1] == layer:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((layer, 1))
    return spans
