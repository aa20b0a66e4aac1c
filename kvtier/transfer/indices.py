"""Index arrays on the device, uploaded on the transfer's own stream from an arena sized up front.

The arena is a pinned host buffer and a device buffer of the same size, used as a ring of byte ranges: each upload
takes the next range, and a range is rewritten only after the event recorded behind the work that read it has
completed. Both buffers are allocated when the engine is built, because ``cudaHostAlloc``/``cudaMalloc``/``cudaFree``
wait for every stream of the device: allocating inside ``load()`` made a load queued beside 95 ms of compute return
after 95 ms and lost layer-wise overlap (H200). Only a transfer larger than the whole arena grows it (and pays that
wait once); size the arena with ``index_ring_bytes`` to avoid even that.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.memory import DeviceAddress, DeviceBuffer, HostBuffer, HostKind
from kvtier.runtime import Event, Runtime, Stream

ALIGN = 16
MIN_BYTES = 1 << 12


class Lease:
    """A byte range of the arena in use by one transfer until :meth:`IndexRing.fence` marks its end."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.done: Event | None = None


class IndexRing:
    def __init__(self, runtime: Runtime, device: int, stream: Stream, capacity: int) -> None:
        self.runtime, self.device, self.stream = runtime, device, stream
        self._leases: deque[Lease] = deque()
        self._head = 0
        self._host: HostBuffer | None = None
        self._device: DeviceBuffer | None = None
        self._allocate(max(capacity, MIN_BYTES))

    @property
    def capacity(self) -> int:
        return 0 if self._host is None else self._host.nbytes

    def _allocate(self, capacity: int) -> None:
        capacity = -(-capacity // ALIGN) * ALIGN
        host = HostBuffer.allocate(capacity, HostKind.PINNED, runtime=self.runtime)
        try:
            device = DeviceBuffer(capacity, self.device, runtime=self.runtime)
        except BaseException:
            host.close()
            raise
        self._release()
        self._host, self._device, self._head = host, device, 0
        self._view = host.as_tensor().numpy()

    def upload(self, arrays: list[np.ndarray]) -> tuple[list[DeviceAddress], Lease]:
        """Queue the arrays' upload on the stream; returns their device addresses and the lease to fence."""
        sizes = [-(-a.nbytes // ALIGN) * ALIGN for a in arrays]
        need = max(sum(sizes), ALIGN)
        if need > self.capacity:
            self._drain()
            self._allocate(2 * need)
        start = self._head if self._head + need <= self.capacity else 0
        lease = Lease(start, start + need)
        self._wait_for(lease)
        offset = start
        for array, size in zip(arrays, sizes, strict=True):
            self._view[offset:offset + array.nbytes] = array.view(np.uint8).reshape(-1)
            offset += size
        host, device = self._buffers()
        self.runtime.memcpy_async(device.address + start, host.cpu_address + start, need, stream=self.stream)
        self._head = lease.end
        self._leases.append(lease)
        addresses, offset = [], start
        for size in sizes:
            addresses.append(device.address + offset)
            offset += size
        return addresses, lease

    def _buffers(self) -> tuple[HostBuffer, DeviceBuffer]:
        if self._host is None or self._device is None:
            raise BufferClosed("index ring is closed")
        return self._host, self._device

    def fence(self, lease: Lease) -> None:
        """Mark the end of the work that reads ``lease``: its range is reused once the stream gets here."""
        if lease not in self._leases:
            raise InvalidArgument("fence of a lease this ring did not hand out, or fenced twice")
        lease.done = self.runtime.create_event(self.device)
        lease.done.record(self.stream)

    def _wait_for(self, lease: Lease) -> None:
        """Wait for (and drop) every earlier lease that overlaps ``lease``'s range. A lease never fenced (its launch
        failed) has no reader; its upload ran in order on the same stream, so its range is free."""
        for old in list(self._leases):
            if old.start < lease.end and lease.start < old.end:
                if old.done is not None:
                    old.done.synchronize()
                    old.done.close()
                self._leases.remove(old)

    def _drain(self) -> None:
        for lease in self._leases:
            if lease.done is not None:
                lease.done.synchronize()
                lease.done.close()
        self._leases.clear()

    def _release(self) -> None:
        if self._host is not None:
            del self._view
            self._host.close()
        if self._device is not None:
            self._device.close()
        self._host = self._device = None

    def close(self) -> None:
        try:
            self._drain()
        finally:
            self._release()


def arena_bytes(units: int, index_bytes: int, transfers: int = 2) -> int:
    """Room for ``transfers`` transfers of ``units`` units each (two index arrays per transfer)."""
    return transfers * 2 * (-(-units * index_bytes // ALIGN) * ALIGN)

