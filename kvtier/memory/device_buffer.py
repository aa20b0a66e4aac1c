"""Device memory owned by kvtier: pools, staging areas, index rings, test targets, doctor's copy probes."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier import closings
from kvtier.address import CpuAddress, DeviceAddress
from kvtier.checks import integer
from kvtier.errors import BufferClosed, InvalidArgument
from kvtier.memory.lifetime import Drainable, Users
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime


def _free_counted(free: Callable[[int], None], value: int) -> None:
    """A buffer's finalizer: a close, or the collector or interpreter exit dropping it unclosed. Either way its
    ``closed`` now holds (the finalizer is dead), so it counts as a closing before the memory goes."""
    closings.counted()
    free(value)


@dataclass(frozen=True)
class DeviceRegion:
    """An offset view of a device buffer (a layer of a pool, a staging slice); resolve it like the buffer."""

    buffer: DeviceBuffer
    offset: int
    nbytes: int


class DeviceBuffer:
    def __init__(self, nbytes: int, device: int, *, runtime: Runtime | None = None) -> None:
        nbytes = integer(nbytes, "DeviceBuffer size", low=1)
        self.runtime = runtime or get_runtime()
        self.device, self.nbytes = self.runtime.check_device(device), nbytes
        self._value = self.runtime.device_alloc(nbytes, self.device)
        self._finalizer = weakref.finalize(self, _free_counted, self.runtime.device_free, self._value)
        self._users = Users()
        self._closing = False

    @property
    def closed(self) -> bool:
        """Closed, or closing: once close() starts draining its users, no new work may be queued over it."""
        return self._closing or not self._finalizer.alive

    @property
    def address(self) -> DeviceAddress:
        if self.closed:
            raise BufferClosed(f"{self!r} is closed")
        return DeviceAddress(self._value, self.device)

    def region(self, offset: int, nbytes: int) -> DeviceRegion:
        return DeviceRegion(self, *self.check_span(offset, nbytes, "region"))

    def upload(self, data: bytes | np.ndarray, offset: int = 0) -> None:
        """Copy host bytes in; returns once they are on the device (a pageable copy alone may return earlier)."""
        source = np.ascontiguousarray(np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data)
        offset, _ = self.check_span(offset, source.nbytes, "upload")
        self.runtime.memcpy(self.address + offset, CpuAddress(source.ctypes.data), source.nbytes)
        self.runtime.legacy_stream(self.device).synchronize()

    def download(self, offset: int = 0, nbytes: int | None = None) -> bytes:
        offset = integer(offset, "download offset", low=0)
        offset, nbytes = self.check_span(offset, self.nbytes - offset if nbytes is None else nbytes, "download")
        out = np.empty(nbytes, np.uint8)
        self.runtime.memcpy(CpuAddress(out.ctypes.data), self.address + offset, nbytes)
        return out.tobytes()

    def check_span(self, offset: int, nbytes: int, what: str = "span") -> tuple[int, int]:
        """[offset, offset + nbytes) as ints, if it lies inside the open buffer."""
        if self.closed:
            raise BufferClosed(f"{self!r} is closed")
        offset, nbytes = integer(offset, f"{what} offset", low=0), integer(nbytes, f"{what} size", low=0)
        if offset + nbytes > self.nbytes:
            raise InvalidArgument(f"{what} [{offset}, +{nbytes}) is outside {self!r}")
        return offset, nbytes

    def add_user(self, user: Drainable) -> None:
        """``user`` queues device work over this buffer: :meth:`close` waits for it first."""
        self._users.add(user)

    def remove_user(self, user: Drainable) -> None:
        self._users.discard(user)

    def close(self) -> None:
        """Wait for every user's queued work, then free (cudaFree itself would also wait for the device). Idempotent."""
        if self.closed or self._closing:
            return
        self._closing = True
        closings.counted()
        try:
            self._users.drain()
        finally:
            self._finalizer()

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DeviceBuffer {self.nbytes} bytes on device {self.device} of {self.runtime.name}>"
