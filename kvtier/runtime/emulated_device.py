"""The pieces of an emulated GPU: its address map, the memory view its kernels get, its streams and events.

Device memory and registered-host aliases are entries of a per-device :class:`AddressMap` that point at real host
memory underneath. A kernel only ever sees a :class:`DeviceMemory`, which translates every address through the map of
the device it runs on, so a CPU address (split mode) or another device's address faults exactly as on a GPU.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvtier import osmem
from kvtier.errors import IllegalAddress, RuntimeCallError
from kvtier.runtime.base import Event, Graph, Stream
from kvtier.runtime.ranges import RangeIndex


class MappingKind(enum.Enum):
    DEVICE_MEMORY = "device memory"
    HOST_ALIAS = "registered host alias"


@dataclass(frozen=True)
class Mapping:
    backing: int
    kind: MappingKind


class AddressMap:
    """Device address → backing host address, for one device."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.ranges = RangeIndex[Mapping]()

    def add(self, address: int, nbytes: int, backing: int, kind: MappingKind) -> None:
        self.ranges.add(address, nbytes, Mapping(backing, kind))

    def lookup(self, address: int, nbytes: int) -> tuple[int, Mapping] | None:
        entry = self.ranges.find(address, nbytes)
        if entry is None:
            return None
        return entry.value.backing + (address - entry.start), entry.value

    def translate(self, address: int, nbytes: int) -> int:
        found = self.lookup(address, nbytes)
        if found is None:
            raise IllegalAddress(
                f"emulated device {self.device}: illegal address 0x{address:x} (+{nbytes} bytes) is not mapped on "
                f"this device; kernels need the device alias of registered host memory, not its CPU address"
            )
        return found[0]


class DeviceMemory:
    """What an emulated kernel can touch: every access goes through its device's address map."""

    def __init__(self, address_map: AddressMap) -> None:
        self._map = address_map
        self.device = address_map.device

    def view(self, address: int, nbytes: int) -> np.ndarray:
        """A writable uint8 array over [address, address + nbytes) as this device sees it."""
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        backing = self._map.translate(int(address), nbytes)
        return np.ctypeslib.as_array(osmem.byte_array(backing, nbytes))

    def read(self, address: int, nbytes: int) -> bytes:
        return self.view(address, nbytes).tobytes()

    def write(self, address: int, data: bytes | np.ndarray) -> None:
        source = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else data.view(np.uint8)
        self.view(address, source.size)[:] = source.reshape(-1)


class EmulatedStream(Stream):
    """Work is queued and runs, in order, when someone waits on the stream or on an event recorded in it.

    Deferring the work (rather than running it at enqueue) is deliberate: code that reads a destination before
    synchronizing sees stale bytes here just as it would on a GPU.
    """

    def __init__(self, device: int, handle: int) -> None:
        self.device, self.handle = device, handle
        self._pending: collections.deque[Callable[[], None]] = collections.deque()
        self._captured: list[Callable[[], None]] | None = None
        self._closed = False

    def enqueue(self, op: Callable[[], None]) -> None:
        if self._closed:
            raise ValueError(f"stream {self.handle} on emulated device {self.device} is closed")
        if self._captured is not None:
            self._captured.append(op)
        else:
            self._pending.append(op)

    @property
    def capturing(self) -> bool:
        return self._captured is not None

    def begin_capture(self) -> None:
        if self.handle == 0:
            raise RuntimeCallError("cudaStreamBeginCapture", "cudaErrorStreamCaptureUnsupported",
                                   "the legacy default stream cannot be captured")
        if self._captured is not None:
            raise RuntimeCallError("cudaStreamBeginCapture", "cudaErrorIllegalState", "already capturing")
        self._captured = []

    def end_capture(self) -> "EmulatedGraph":
        if self._captured is None:
            raise RuntimeCallError("cudaStreamEndCapture", "cudaErrorIllegalState", "stream is not capturing")
        ops, self._captured = self._captured, None
        return EmulatedGraph(self.device, ops)

    def run_until_done(self, marker: Callable[[], None]) -> None:
        """Run queued work up to ``marker`` if it is still queued; if it already ran, there is nothing to wait for."""
        if any(op is marker for op in self._pending):
            self.run_until(marker)

    def run_until(self, marker: Callable[[], None] | None = None) -> None:
        while self._pending:
            op = self._pending.popleft()
            try:
                op()
            except BaseException:
                self._pending.clear()
                raise
            if op is marker:
                return

    def synchronize(self) -> None:
        self.run_until(None)

    def wait(self, event: Event) -> None:
        if not isinstance(event, EmulatedEvent):
            raise TypeError(f"an emulated stream waits on emulated events, not {event!r}")
        self.enqueue(event.wait_op())

    def close(self) -> None:
        if not self._closed:
            self.synchronize()
            self._closed = True


class EmulatedGraph(Graph):
    """The captured operations; each replay runs them again against memory as it is then."""

    def __init__(self, device: int, ops: list[Callable[[], None]]) -> None:
        self.device, self._ops = device, ops

    def launch(self, stream: Stream) -> None:
        if not isinstance(stream, EmulatedStream):
            raise TypeError(f"an emulated graph launches on an emulated stream, not {stream!r}")
        for op in self._ops:
            stream.enqueue(op)

    def close(self) -> None:
        self._ops = []


class EmulatedEvent(Event):
    def __init__(self, device: int) -> None:
        self.device = device
        self._stream: EmulatedStream | None = None
        self._marker: Callable[[], None] | None = None
        self.timestamp: float | None = None

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, EmulatedStream):
            raise TypeError(f"an emulated event can only be recorded on an emulated stream, not {stream!r}")
        self.timestamp = None

        def marker() -> None:
            self.timestamp = time.perf_counter()

        self._stream, self._marker = stream, marker
        stream.enqueue(marker)

    def wait_op(self) -> Callable[[], None]:
        """What a waiting stream runs: the work this event marked as of now (a later re-record does not count)."""
        stream, marker = self._stream, self._marker

        def wait() -> None:
            if stream is not None and marker is not None:
                stream.run_until_done(marker)

        return wait

    def query(self) -> bool:
        """The emulator makes progress when observed: querying runs the stream up to this event."""
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self._stream is not None and self._marker is not None and self.timestamp is None:
            self._stream.run_until_done(self._marker)

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, EmulatedEvent):
            raise TypeError("elapsed_ms needs two emulated events")
        self.synchronize()
        end.synchronize()
        if self.timestamp is None or end.timestamp is None:
            raise ValueError("elapsed_ms: both events must have been recorded")
        return (end.timestamp - self.timestamp) * 1e3

    def close(self) -> None:
        self._stream = self._marker = None
