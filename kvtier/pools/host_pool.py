"""The host pool: a HostBuffer holding a pool's pages in one of the four layouts.

It answers two kinds of question, one per pointer domain: where a tensor's layers start *for a device* (aliases, for
pointer tables and kernels) and where a page's bytes are *for the CPU* (``page_metadata``, for storage backends and
disaggregation).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.errors import KvtierError
from kvtier.memory import CpuAddress, DeviceAddress, HostBuffer, HostKind
from kvtier.memory.registration import DEFAULT_REGISTER_CHUNK_BYTES
from kvtier.pools.budget import check_host_budget
from kvtier.pools.device_pool import _check_range
from kvtier.pools.geometry import HostLayout, KVGeometry, Strides, host_strides
from kvtier.runtime import Runtime


class HostPool:
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
        given = [v for v in (pages, tokens, nbytes) if v is not None]
        if len(given) != 1:
            raise KvtierError("size a host pool by exactly one of pages=, tokens= or nbytes=")
        if tokens is not None:
            pages = -(-tokens // geometry.page_size)
        elif nbytes is not None:
            pages = nbytes // geometry.bytes_per_page
        if not pages or pages < 1:
            raise KvtierError(f"a host pool needs at least one page ({geometry.bytes_per_page} bytes each)")
        total = pages * geometry.bytes_per_page
        check_host_budget(total)
        granularity = geometry.page_bytes if HostLayout(layout) is HostLayout.LAYER_FIRST else (
            geometry.layers * geometry.page_bytes)
        buffer = HostBuffer.allocate(total, kind, runtime=runtime, granularity=granularity,
                                     register_chunk_bytes=register_chunk_bytes, name=name)
        return cls(geometry, HostLayout(layout), pages, buffer)

    @property
    def runtime(self) -> Runtime:
        return self.buffer.runtime

    def tensor_offset(self, tensor: int) -> int:
        if not 0 <= tensor < self.geometry.tensors:
            raise KvtierError(f"{self.geometry.kind.value} pools have {self.geometry.tensors} tensor(s), not {tensor}")
        return tensor * self.tensor_bytes

    def layer_addresses(self, tensor: int, device: int) -> list[DeviceAddress]:
        """Per-layer base aliases for ``device``: what goes in this pool's pointer table."""
        base = self.buffer.device_address(device, self.tensor_offset(tensor), self.tensor_bytes)
        return [base + layer * self.strides.layer for layer in range(self.geometry.layers)]

    def layer_cpu_addresses(self, tensor: int) -> list[CpuAddress]:
        base = self.buffer.cpu_address + self.tensor_offset(tensor)
        return [base + layer * self.strides.layer for layer in range(self.geometry.layers)]

    def check_pages(self, pages: Any) -> None:
        _check_range(pages, self.pages, "host page")

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

    def page_metadata(self, pages: Any) -> list[list[tuple[CpuAddress, int]]]:
        """CPU-domain (address, length) pieces of each page, for storage and disaggregation consumers."""
        values = np.asarray(pages, dtype=np.int64).reshape(-1)
        self.check_pages(values)
        cpu = self.buffer.cpu_address
        return [[(cpu + offset, size) for offset, size in self.page_spans(int(p))] for p in values]

    def close(self) -> None:
        self.buffer.close()
