"""Pools of page rows: the DSA indexer (DeepSeek-V3.2) and DeepSeek-V4's C4 KV, C4 indexer and C128 pools.

A page row holds ``page_size`` tokens of one layer as *regions*: all tokens' first region, then all tokens' second, and
so on — a C4 KV row keeps the 576-byte values of its tokens apart from their 8-byte scales, a DSA indexer row its
packed index keys apart from their fp32 scales. Whole pages move as one chunk per layer; a token moves as one chunk
per region. Pools that cannot split a page (``token_granular=False``: the FP4 indexer packs two values per byte and
keeps its rows per page for the tensor cores; the DSA indexer moves pages only) refuse token transfers that are not
whole, aligned pages. Only ``stored_layers`` have rows: layers that reuse another layer's top-k have no indexer, on the
device or the host.

Host layouts: ``layer_first`` [layer][page][row] and ``page_first`` [page][layer][row] (a page is one run: storage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.checks import integer
from kvtier.errors import InvalidArgument
from kvtier.memory import HostKind
from kvtier.memory.registration import DEFAULT_REGISTER_CHUNK_BYTES
from kvtier.pools.family import (
    FamilyDevicePool,
    FamilyHostPool,
    Part,
    Placement,
    allocate_parts,
    host_units,
    region_of,
)
from kvtier.pools.geometry import HostLayout
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime

ROW_LAYOUTS = (HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST)
"""The host layouts a page-row pool keeps."""


@dataclass(frozen=True)
class PagedRowGeometry:
    name: str
    layers: int
    page_size: int
    regions: tuple[tuple[str, int], ...]
    stored_layers: tuple[int, ...] = ()
    token_granular: bool = True

    def __post_init__(self) -> None:
        integer(self.layers, "layers", low=1)
        integer(self.page_size, "page_size", low=1)
        if not self.regions or any(integer(b, f"region {n} bytes", low=1) < 1 for n, b in self.regions):
            raise InvalidArgument("a page row needs at least one region of positive bytes per token")
        stored = tuple(self.stored_layers) or tuple(range(self.layers))
        if sorted(set(stored)) != list(stored) or stored[0] < 0 or stored[-1] >= self.layers:
            raise InvalidArgument(f"stored layers {stored} must be increasing layers of the model's {self.layers}")
        object.__setattr__(self, "stored_layers", stored)

    @classmethod
    def dsa_indexer(cls, layers: int, *, index_head_dim: int = 128, quant_block_size: int = 128,
                    page_size: int = 64, stored_layers: Sequence[int] = ()) -> PagedRowGeometry:
        """DeepSeek-V3.2 sparse attention's indexer keys: fp8 keys plus an fp32 scale per quantization block, per
        token (index_head_dim + index_head_dim / quant_block_size * 4 bytes: 132 for the defaults); pages only."""
        if index_head_dim % quant_block_size:
            raise InvalidArgument(f"index_head_dim {index_head_dim} is not a multiple of the {quant_block_size}-wide "
                                  f"quantization block")
        return cls("dsa_indexer", layers, page_size,
                   (("keys", index_head_dim), ("scales", index_head_dim // quant_block_size * 4)),
                   tuple(stored_layers), token_granular=False)

    @classmethod
    def dsv4_c4_kv(cls, layers: int, *, page_size: int = 64, value_bytes: int = 576, scale_bytes: int = 8,
                   stored_layers: Sequence[int] = ()) -> PagedRowGeometry:
        """DeepSeek-V4's 4x-compressed KV: a 576-byte value and an 8-byte scale per compressed token."""
        return cls("dsv4_c4_kv", layers, page_size, (("values", value_bytes), ("scales", scale_bytes)),
                   tuple(stored_layers))

    @classmethod
    def dsv4_c4_indexer(cls, layers: int, *, page_size: int = 64, index_head_dim: int = 128, block: int = 32,
                        stored_layers: Sequence[int] = ()) -> PagedRowGeometry:
        """DeepSeek-V4's indexer over C4 tokens in FP4 (two values per byte, one ue8m0 scale byte per ``block``):
        packed per page, so only whole pages move."""
        return cls("dsv4_c4_indexer", layers, page_size, (("keys", index_head_dim // 2),
                                                            ("scales", index_head_dim // block)),
                   tuple(stored_layers), token_granular=False)

    @classmethod
    def dsv4_c128(cls, layers: int, *, page_size: int = 64, value_bytes: int = 576, scale_bytes: int = 8,
                  stored_layers: Sequence[int] = ()) -> PagedRowGeometry:
        """DeepSeek-V4's 128x-compressed KV: rows like C4's over 128-token blocks."""
        return cls("dsv4_c128", layers, page_size, (("values", value_bytes), ("scales", scale_bytes)),
                   tuple(stored_layers))

    @property
    def token_bytes(self) -> int:
        return sum(b for _, b in self.regions)

    @property
    def page_bytes(self) -> int:
        """One layer's row of one page."""
        return self.page_size * self.token_bytes

    @property
    def bytes_per_page(self) -> int:
        return len(self.stored_layers) * self.page_bytes

    def region_offsets(self) -> list[tuple[str, int, int]]:
        """(name, offset in the row, bytes per token) of each region."""
        out, offset = [], 0
        for name, size in self.regions:
            out.append((name, offset, size))
            offset += self.page_size * size
        return out

    def parts(self, unit: str) -> list[Part]:
        if unit == "page":
            return [Part("row", self.stored_layers, "page", self.page_bytes)]
        return [Part(name, self.stored_layers, "token", size, 1, self.page_size) for name, size in self.regions]

    def whole_pages(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The page pairs a token transfer covers when it is whole, aligned pages on both sides, else None."""
        size = self.page_size
        if src.size % size:
            return None
        s, d = src.reshape(-1, size), dst.reshape(-1, size)
        ramp = np.arange(size)
        if (s[:, :1] % size).any() or (d[:, :1] % size).any() or (s - s[:, :1] != ramp).any() or \
                (d - d[:, :1] != ramp).any():
            return None
        return s[:, 0] // size, d[:, 0] // size


def _placements(geometry: PagedRowGeometry, unit: str, bases: Sequence[Any], page_stride: int
                ) -> dict[str, tuple[Part, Placement]]:
    """Each part of a ``unit`` transfer, placed at per-layer ``bases`` (device operands or buffer offsets)."""
    g = geometry
    if unit == "page":
        part, = g.parts("page")
        return {part.name: (part, Placement(tuple(bases), page_stride, 0, part.chunk_bytes))}
    out = {}
    for part, (_, offset, size) in zip(g.parts("token"), g.region_offsets(), strict=True):
        shifted = tuple(region_of(b, offset, g.page_bytes - offset) if not isinstance(b, int) else b + offset
                        for b in bases)
        out[part.name] = (part, Placement(shifted, page_stride, size, size))
    return out


class PagedRowHostPool(FamilyHostPool):
    bases: list[int]
    page_stride: int

    @classmethod
    def allocate(cls, geometry: PagedRowGeometry, layout: HostLayout | str = HostLayout.PAGE_FIRST, *,
                 pages: int | None = None, nbytes: int | None = None, kind: HostKind | str = HostKind.REGISTERED,
                 runtime: Runtime | None = None, register_chunk_bytes: int = DEFAULT_REGISTER_CHUNK_BYTES,
                 name: str | None = None) -> PagedRowHostPool:
        layout = HostLayout.of(layout, ROW_LAYOUTS, "a page-row host pool's layout")
        g = geometry
        count = host_units(pages, None, nbytes, g.bytes_per_page, "pages")
        stored = len(g.stored_layers)
        granularity = g.page_bytes if layout is HostLayout.LAYER_FIRST else g.bytes_per_page
        buffer = cls.make_buffer(count * g.bytes_per_page, kind, runtime, register_chunk_bytes, granularity, name)
        if layout is HostLayout.LAYER_FIRST:
            bases, stride = [i * count * g.page_bytes for i in range(stored)], g.page_bytes
        else:
            bases, stride = [i * g.page_bytes for i in range(stored)], g.bytes_per_page
        pool = cls(g, layout.value, count, buffer, {})
        pool.bases, pool.page_stride = bases, stride
        return pool

    def placement(self, part: Part) -> Placement:
        _, placement = _placements(self.geometry, part.unit, self.bases, self.page_stride)[part.name]
        regions = tuple(self.buffer.region(b, self.buffer.nbytes - b) for b in placement.bases)
        return Placement(regions, placement.page_stride, placement.unit_stride, part.chunk_bytes)

    def cpu_offsets(self, part: Part) -> tuple[list[int], int, int]:
        _, placement = _placements(self.geometry, part.unit, self.bases, self.page_stride)[part.name]
        return list(placement.bases), placement.page_stride, placement.unit_stride


class PagedRowDevicePool(FamilyDevicePool):
    """The engine's device rows: per stored layer, ``pages`` rows of ``page_stride`` bytes (>= a row)."""

    def __init__(self, geometry: PagedRowGeometry, pages: int, device: int, runtime: Runtime, layers: Sequence[Any],
                 page_stride: int, keep: Sequence[Any] = (), owned: Sequence[Any] = ()) -> None:
        from kvtier.memory import get_device_accessible_ptr

        g = geometry
        if len(layers) != len(g.stored_layers):
            raise InvalidArgument(f"{len(layers)} layer arrays for {len(g.stored_layers)} stored layers")
        if page_stride < g.page_bytes:
            raise InvalidArgument(f"a page stride of {page_stride} bytes is shorter than a {g.page_bytes}-byte row")
        resolved = [get_device_accessible_ptr(op, device, runtime=runtime) for op in layers]
        parts = {**_placements(g, "page", resolved, page_stride), **_placements(g, "token", resolved, page_stride)}
        self.page_stride = page_stride
        super().__init__(g, pages, device, runtime, parts, keep=[*keep, *layers], owned=owned, operands=layers)

    @classmethod
    def allocate(cls, geometry: PagedRowGeometry, pages: int, device: int, *, runtime: Runtime | None = None,
                 pad: int = 0) -> PagedRowDevicePool:
        runtime = runtime or get_runtime()
        pages = integer(pages, "pages", low=1)
        stride = geometry.page_bytes + integer(pad, "pad", low=0)
        buffers, owned = allocate_parts({"rows": [pages * stride] * len(geometry.stored_layers)}, device, runtime)
        return cls(geometry, pages, device, runtime, buffers["rows"], stride, owned=owned)

    @classmethod
    def from_tensors(cls, geometry: PagedRowGeometry, layers: Sequence[Any], *,
                     runtime: Runtime | None = None) -> PagedRowDevicePool:
        """``layers``: one CUDA tensor per stored layer, [pages, ...] with each page's row contiguous (uint8 or any
        dtype), pages evenly spaced."""
        runtime = runtime or get_runtime()
        layers = list(layers)
        if len(layers) != len(geometry.stored_layers):
            raise InvalidArgument(f"{len(layers)} layer tensors for {len(geometry.stored_layers)} stored layers")
        first = layers[0]
        for i, layer in enumerate(layers):
            if (layer.shape, layer.stride(), layer.dtype, layer.device) != (first.shape, first.stride(), first.dtype,
                                                                            first.device):
                raise InvalidArgument(f"layer tensor {i} is {layer.dtype} {tuple(layer.shape)} strides "
                                      f"{layer.stride()} on {layer.device}; every layer must match the first "
                                      f"({first.dtype} {tuple(first.shape)} strides {first.stride()} on "
                                      f"{first.device})")
        row = first[0].numel() * first.element_size()
        if row < geometry.page_bytes or not first[0].is_contiguous():
            raise InvalidArgument(f"a page holds {row} contiguous bytes, a row needs {geometry.page_bytes}")
        stride = first.stride()[0] * first.element_size()
        return cls(geometry, int(first.shape[0]), int(first.device.index or 0), runtime, list(layers), stride)
