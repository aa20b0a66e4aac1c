"""Device memory owned by kvtier: staging buffers, test targets, doctor's copy probes."""

from __future__ import annotations

import weakref

import numpy as np

from kvtier.errors import BufferClosed, KvtierError
from kvtier.memory.address import DeviceAddress
from kvtier.runtime import Runtime
from kvtier.runtime import get as get_runtime


class DeviceBuffer:
    def __init__(self, nbytes: int, device: int, *, runtime: Runtime | None = None) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise KvtierError(f"DeviceBuffer size must be a positive int, got {nbytes!r}")
        self.runtime = runtime or get_runtime()
        self.device, self.nbytes = self.runtime.check_device(device), nbytes
        self._value = self.runtime.device_alloc(nbytes, device)
        self._finalizer = weakref.finalize(self, self.runtime.device_free, self._value)

    @property
    def address(self) -> DeviceAddress:
        if not self._finalizer.alive:
            raise BufferClosed(f"{self!r} is closed")
        return DeviceAddress(self._value, self.device)

    def upload(self, data: bytes | np.ndarray, offset: int = 0) -> None:
        """Copy host bytes in through the runtime's copy API (a CPU-side call)."""
        source = np.ascontiguousarray(np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data)
        self._check_span(offset, source.nbytes)
        self.runtime.memcpy(self.address.value + offset, source.ctypes.data, source.nbytes)

    def download(self, offset: int = 0, nbytes: int | None = None) -> bytes:
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        self._check_span(offset, nbytes)
        out = np.empty(nbytes, np.uint8)
        self.runtime.memcpy(out.ctypes.data, self.address.value + offset, nbytes)
        return out.tobytes()

    def _check_span(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise KvtierError(f"[{offset}, +{nbytes}) is outside {self!r}")

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> DeviceBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DeviceBuffer {self.nbytes} bytes on device {self.device} of {self.runtime.name}>"
