"""The host pool: a HostBuffer holding a pool's pages in one of the four layouts.

It answers two kinds of question, one per pointer domain: which region of the buffer a tensor's layer covers (regions
go through the one resolver to become device addresses, for pointer tables and kernels) and where a page's bytes are
*for the CPU* (``layer_cpu_addresses``, ``page_metadata``: DMA copies, storage backends and disaggregation).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.checks import index_array, integer
from kvtier.errors import InvalidArgument
from kvtier.memory import CpuAddress, HostBuffer, HostKind, HostRegion
from kvtier.memory.lifetime import Drainable
from kvtier.memory.registration import DEFAULT_REGISTER_CHUNK_BYTES
from kvtier.pools.device_pool import check_range
from kvtier.pools.geometry import HostLayout, KVGeometry, Strides, host_strides
from kvtier.runtime import Runtime


class HostPoolLifetime:
    """The lifetime every host pool shares: it is its buffer's (closing waits for the engines queued over it)."""

    buffer: HostBuffer

    @property
    def closed(self) -> bool:
        return self.buffer.closed

    def check_open(self) -> None:
        self.buffer.check_span(0, 0, "host pool")

    def add_user(self, user: Drainable) -> None:
        """``user`` (an engine) queues device work over this pool: closing the pool or its buffer waits for it."""
        self.buffer.add_user(user)

    def remove_user(self, user: Drainable) -> None:
        self.buffer.remove_user(user)

    def close(self) -> None:
        """Wait for the transfers engines queued over the pool, then release its buffer. Idempotent."""
        self.buffer.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        """As the buffer's: a view still alive when the body raised does not hide the body's exception."""
        self.buffer.__exit__(exc_type, exc, traceback)


class HostPool(HostPoolLifetime):
    def __init__(self, geometry: KVGeometry, layout: HostLayout, pages: int, buffer: HostBuffer) -> None:
        self.geometry, self.layout, self.pages, self.buffer = geometry, HostLayout(layout), pages, buffer
        self.strides: Strides = host_strides(geometry, self.layout, pages)
        self.tensor_bytes = pages * geometry.layers * geometry.page_bytes

    @classmethod
    def allocate(cls, geometry: KVGeometry, layout: HostLayout | str, *, pages: int | None = None,
                 tokens: int | None = None, nbytes: int | None = None, kind: HostKind | str = HostKind.REGISTERED,
                 runtime: Runtime | None = None, register_chunk_bytes: int = DEFAULT_REGISTER_CHUNK_BYTES,
                 name: str | None = None) -> HostPool:
        """Size by exactly one of ``pages``, ``tokens`` (rounded up to pages) or ``nbytes`` (rounded down)."""
        layout = HostLayout(layout)
        given = {k: v for k, v in (("pages", pages), ("tokens", tokens), ("nbytes", nbytes)) if v is not None}
        if len(given) != 1:
            raise InvalidArgument("size a host pool by exactly one of pages=, tokens= or nbytes=")
        (what, value), = given.items()
        value = integer(value, what, low=1)
        count = {"pages": value, "tokens": -(-value // geometry.page_size),
                 "nbytes": value // geometry.bytes_per_page}[what]
        if count < 1:
            raise InvalidArgument(f"a host pool needs at least one page ({geometry.bytes_per_page} bytes each)")
        total = count * geometry.bytes_per_page
        granularity = geometry.page_bytes if layout is HostLayout.LAYER_FIRST else geometry.layers * geometry.page_bytes
        buffer = HostBuffer.allocate(total, kind, runtime=runtime, granularity=granularity,
                                     register_chunk_bytes=register_chunk_bytes, name=name)
        return cls(geometry, layout, count, buffer)

    @property
    def runtime(self) -> Runtime:
        return self.buffer.runtime

    def tensor_offset(self, tensor: int) -> int:
        if not 0 <= tensor < self.geometry.tensors:
            raise InvalidArgument(f"{self.geometry.kind.value} pools have {self.geometry.tensors} tensor(s), not "
                                  f"{tensor}")
        return tensor * self.tensor_bytes

    def layer_regions(self, tensor: int) -> list[HostRegion]:
        """Per layer, the region from the layer's base to the end of the tensor: every byte a kernel walking that
        layer may touch. Resolve them (``get_device_accessible_ptr``) to fill a pointer table."""
        base = self.tensor_offset(tensor)
        return [self.buffer.region(base + layer * self.strides.layer, self.tensor_bytes - layer * self.strides.layer)
                for layer in range(self.geometry.layers)]

    def layer_cpu_addresses(self, tensor: int) -> list[CpuAddress]:
        """Per-layer base addresses in the CPU domain: what copy engines and CPU-side consumers use."""
        base = self.buffer.cpu_address + self.tensor_offset(tensor)
        return [base + layer * self.strides.layer for layer in range(self.geometry.layers)]

    def check_pages(self, pages: np.ndarray) -> None:
        check_range(pages, self.pages, "host page")

    def page_spans(self, page: int) -> list[tuple[int, int]]:
        """(offset, size) of the contiguous pieces holding ``page``, per tensor, in buffer offsets."""
        g, s = self.geometry, self.strides
        spans = []
        for tensor in range(g.tensors):
            base = self.tensor_offset(tensor)
            if self.layout is HostLayout.LAYER_FIRST:
                spans += [(base + layer * s.layer + page * s.page, g.page_bytes) for layer in range(g.layers)]
            else:
                spans.append((base + page * s.page, g.layers * g.page_bytes))
        return spans

    def page_pieces(self, pages: Any) -> tuple[np.ndarray, np.ndarray]:
        """Buffer offsets ``[pages, pieces]`` and sizes ``[pieces]`` of each page's contiguous pieces (the spans of
        :meth:`page_spans`, for many pages in one numpy step: a ``layer_first`` page has a piece per layer and
        tensor, and a 32k-token prompt has 2,048 pages)."""
        values = index_array(pages, "pages").astype(np.int64, copy=False)
        self.check_pages(values)
        g, s = self.geometry, self.strides
        if self.layout is HostLayout.LAYER_FIRST:
            starts = [self.tensor_offset(t) + layer * s.layer for t in range(g.tensors) for layer in range(g.layers)]
            sizes = np.full(len(starts), g.page_bytes, dtype=np.int64)
        else:
            starts = [self.tensor_offset(t) for t in range(g.tensors)]
            sizes = np.full(len(starts), g.layers * g.page_bytes, dtype=np.int64)
        return values[:, None] * s.page + np.asarray(starts, dtype=np.int64)[None, :], sizes

    def page_metadata(self, pages: Any) -> list[list[tuple[CpuAddress, int]]]:
        """CPU-domain (address, length) pieces of each page, for storage and disaggregation consumers."""
        offsets, sizes = self.page_pieces(pages)
        cpu, sizes_list = self.buffer.cpu_address, sizes.tolist()
        return [[(cpu + offset, size) for offset, size in zip(row, sizes_list, strict=True)]
                for row in offsets.tolist()]

    def __repr__(self) -> str:
        return f"<HostPool {self.layout.value} {self.pages} pages, {self.buffer!r}>"
