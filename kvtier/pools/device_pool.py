"""The engine's layer-first device pool, seen by kvtier as per-tensor, per-layer base addresses.

Engines own their KV tensors; ``DevicePool.from_tensors`` wraps them (torch CUDA tensors). ``DevicePool.allocate``
makes one from device buffers — what tests, benchmarks and the emulator use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.errors import KvtierError
from kvtier.memory import DeviceAddress, DeviceBuffer, get_device_accessible_ptr
from kvtier.pools.geometry import KVGeometry
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime


class DevicePool:
    def __init__(self, geometry: KVGeometry, pages: int, device: int, runtime: Runtime,
                 layers: list[list[DeviceAddress]], owned: Sequence[DeviceBuffer] = ()) -> None:
        self.geometry, self.pages, self.device, self.runtime = geometry, pages, device, runtime
        self.layers = layers
        self._owned = list(owned)

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.geometry.page_bytes

    @classmethod
    def allocate(cls, geometry: KVGeometry, pages: int, device: int, *, runtime: Runtime | None = None) -> DevicePool:
        runtime = runtime or get_runtime()
        buffers = [[DeviceBuffer(pages * geometry.page_bytes, device, runtime=runtime) for _ in range(geometry.layers)]
                   for _ in range(geometry.tensors)]
        layers = [[b.address for b in per_tensor] for per_tensor in buffers]
        return cls(geometry, pages, device, runtime, layers, [b for per_tensor in buffers for b in per_tensor])

    @classmethod
    def from_tensors(cls, geometry: KVGeometry, tensors: Sequence[Sequence[Any]], *,
                     runtime: Runtime | None = None) -> DevicePool:
        """``tensors[t][layer]``: contiguous CUDA tensors of one device, each ``pages * page_size`` rows."""
        runtime = runtime or get_runtime()
        if len(tensors) != geometry.tensors or any(len(t) != geometry.layers for t in tensors):
            raise KvtierError(f"expected {geometry.tensors} tensor lists of {geometry.layers} layers")
        first = tensors[0][0]
        device = first.device.index
        nbytes = first.numel() * first.element_size()
        if nbytes % geometry.page_bytes:
            raise KvtierError(f"a layer of {nbytes} bytes is not a whole number of {geometry.page_bytes}-byte pages")
        layers = []
        for per_tensor in tensors:
            row = []
            for tensor in per_tensor:
                if not tensor.is_contiguous() or tensor.numel() * tensor.element_size() != nbytes:
                    raise KvtierError("every layer tensor must be contiguous and of the same size")
                row.append(get_device_accessible_ptr(tensor, device, runtime=runtime))
            layers.append(row)
        return cls(geometry, nbytes // geometry.page_bytes, device, runtime, layers)

    def check_pages(self, pages: Any, what: str = "device page") -> None:
        _check_range(pages, self.pages, what)

    def close(self) -> None:
        for buffer in self._owned:
            buffer.close()
        self._owned.clear()


def _check_range(pages: Any, limit: int, what: str) -> None:
    import numpy as np

    values = np.asarray(pages)
    if values.size and (values.min() < 0 or values.max() >= limit):
        bad = values[(values < 0) | (values >= limit)][0]
        raise KvtierError(f"{what} index {int(bad)} is out of range (pool has {limit} pages)")
