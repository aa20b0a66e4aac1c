"""The engine's layer-first device pool, seen by kvtier as per-tensor, per-layer operands.

Engines own their KV tensors; ``DevicePool.from_tensors`` wraps them (torch CUDA tensors) and keeps them alive as long
as the pool: holding only their addresses would let torch's caching allocator hand the memory to other tensors while
kvtier still writes there. ``DevicePool.allocate`` makes one from device buffers — what tests, benchmarks and the
emulator use. A closed pool refuses every use; closing waits for the transfers engines queued over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier import closings
from kvtier.checks import integer
from kvtier.errors import BufferClosed, InvalidArgument, MisalignedAddress
from kvtier.memory import DeviceAddress, DeviceBuffer, DeviceRegion, get_device_accessible_ptr
from kvtier.memory.lifetime import Drainable, Users
from kvtier.pools.geometry import KVGeometry
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime

ALIGNMENT = 16
"""Layer bases must allow the transfer kernel's 16-byte vector accesses."""


class DevicePoolLifetime:
    """The lifetime every device pool shares: the device buffers under its operands (one closed by someone else
    closes the pool), the engines queued over it (closing waits for them), what it owns (freed on close) and what it
    holds (engine tensors, dropped on close)."""

    def _track(self, operands: Sequence[Any], owned: Sequence[DeviceBuffer] = (), keep: Sequence[Any] = ()) -> None:
        self._owned, self._keep = list(owned), list(keep)
        self._buffers = list({id(b): b for b in (_buffer_of(op) for op in operands) if b is not None}.values())
        self._users = Users()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Closed itself, or any device buffer under its operands closed by someone else."""
        return self._closed or any(buffer.closed for buffer in self._buffers)

    def check_open(self) -> None:
        if self.closed:
            raise BufferClosed(f"{self!r} is closed")

    def add_user(self, user: Drainable) -> None:
        """``user`` (an engine) queues device work over this pool: :meth:`close` waits for it first."""
        self.check_open()
        self._users.add(user)
        for buffer in self._buffers:
            buffer.add_user(user)

    def remove_user(self, user: Drainable) -> None:
        self._users.discard(user)
        for buffer in self._buffers:
            buffer.remove_user(user)

    def close(self) -> None:
        """Wait for the transfers engines queued over the pool, then free owned memory and drop held tensors.
        Idempotent."""
        if self._closed:
            return
        self._closed = True     # new work over the pool is refused from here on
        closings.counted()
        self._users.close(self._free, self._reopen)

    def _reopen(self) -> None:
        self._closed = False

    def _free(self) -> None:
        for buffer in self._owned:
            buffer.close()
        self._owned, self._keep, self._buffers = [], [], []
        self._dropped()

    def _dropped(self) -> None:
        """What a pool lets go of besides its buffers when it closes."""

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DevicePool(DevicePoolLifetime):
    def __init__(self, geometry: KVGeometry, pages: int, device: int, runtime: Runtime, layers: list[list[Any]],
                 owned: Sequence[DeviceBuffer] = ()) -> None:
        """``layers[t][layer]``: an operand the resolver understands (a DeviceBuffer, a region, a CUDA tensor). A
        buffer or region under the pool closed by someone else closes the pool (a cache over it refuses its next
        call); a bare ``DeviceAddress`` carries no lifetime, so memory given that way is the caller's to keep alive
        until the pool (and any cache over it) is closed."""
        self.geometry, self.pages, self.device, self.runtime = geometry, pages, device, runtime
        self.layers = layers
        self._addresses = [[get_device_accessible_ptr(op, device, runtime=runtime) for op in row] for row in layers]
        for tensor, row in enumerate(self._addresses):
            for layer, address in enumerate(row):
                if not address.aligned(ALIGNMENT):
                    raise MisalignedAddress(f"tensor {tensor} layer {layer} starts at {address}, not {ALIGNMENT}-byte "
                                            f"aligned: the transfer kernels copy 16 bytes at a time")
        self._track([op for row in layers for op in row], owned)

    @property
    def layer_bytes(self) -> int:
        return self.pages * self.geometry.page_bytes

    @classmethod
    def allocate(cls, geometry: KVGeometry, pages: int, device: int, *, runtime: Runtime | None = None) -> DevicePool:
        runtime = runtime or get_runtime()
        pages = integer(pages, "pages", low=1)
        buffers: list[list[DeviceBuffer]] = []
        try:
            for _ in range(geometry.tensors):
                buffers.append([])
                for _ in range(geometry.layers):
                    buffers[-1].append(DeviceBuffer(pages * geometry.page_bytes, device, runtime=runtime))
        except BaseException:
            for buffer in (b for row in buffers for b in row):
                buffer.close()
            raise
        return cls(geometry, pages, device, runtime, [list(row) for row in buffers],
                   [b for row in buffers for b in row])

    @classmethod
    def from_tensors(cls, geometry: KVGeometry, tensors: Sequence[Sequence[Any]], *,
                     runtime: Runtime | None = None) -> DevicePool:
        """``tensors[t][layer]``: contiguous CUDA tensors of one device, each ``pages * page_size`` rows, each
        starting 16-byte aligned. The pool holds references to them until it is closed."""
        runtime = runtime or get_runtime()
        if len(tensors) != geometry.tensors or any(len(t) != geometry.layers for t in tensors):
            raise InvalidArgument(f"expected {geometry.tensors} tensor lists of {geometry.layers} layers")
        first = tensors[0][0]
        device = first.device.index
        nbytes = first.numel() * first.element_size()
        if nbytes == 0 or nbytes % geometry.page_bytes:
            raise InvalidArgument(f"a layer of {nbytes} bytes is not a whole number of {geometry.page_bytes}-byte "
                                  f"pages")
        for t, row in enumerate(tensors):
            for layer, tensor in enumerate(row):
                if not tensor.is_contiguous() or tensor.numel() * tensor.element_size() != nbytes:
                    raise InvalidArgument(f"tensor {t} layer {layer}: every layer tensor must be contiguous and of "
                                          f"the same size ({nbytes} bytes)")
                if tensor.device != first.device:
                    raise InvalidArgument(f"tensor {t} layer {layer} is on {tensor.device}, not {first.device}")
        return cls(geometry, nbytes // geometry.page_bytes, device, runtime, [list(row) for row in tensors])

    def layer_device_addresses(self, tensor: int) -> list[DeviceAddress]:
        """Per-layer base addresses of one tensor, in the pool's device domain (resolved once, at construction)."""
        self.check_open()
        return list(self._addresses[tensor])

    def check_pages(self, pages: np.ndarray, what: str = "device page") -> None:
        check_range(pages, self.pages, what)

    def _dropped(self) -> None:
        self.layers = []

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.pages} pages"
        return f"<DevicePool {self.geometry.kind.value} {state} on device {self.device} of {self.runtime.name}>"


def _buffer_of(operand: Any) -> DeviceBuffer | None:
    if isinstance(operand, DeviceBuffer):
        return operand
    return operand.buffer if isinstance(operand, DeviceRegion) else None


def check_range(pages: np.ndarray, limit: int, what: str) -> None:
    if pages.size and (pages.min() < 0 or pages.max() >= limit):
        bad = pages[(pages < 0) | (pages >= limit)][0]
        raise InvalidArgument(f"{what} index {int(bad)} is out of range (pool has {limit} pages)")
