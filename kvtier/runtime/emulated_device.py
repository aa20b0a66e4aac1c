"""The pieces of an emulated GPU: its address map, the memory view its kernels get, its streams, events and graphs.

Device memory and registered-host aliases are entries of a per-device :class:`AddressMap` that point at real host
memory underneath. A kernel only ever sees a :class:`DeviceMemory`, which translates every address through the map of
the device it runs on, so a CPU address (split mode) or another device's address faults exactly as on a GPU, and so
does a vector access that is not aligned to its width.

Streams hold queued operations; the :class:`~kvtier.runtime.emulated_scheduler.Scheduler` decides when they run.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from kvtier import osmem
from kvtier.errors import IllegalAddress, InvalidArgument, MisalignedAddress, RuntimeCallError, WrongRuntime
from kvtier.runtime.base import Event, Graph, Stream
from kvtier.runtime.ranges import RangeIndex

if TYPE_CHECKING:
    from kvtier.runtime.emulated_scheduler import Scheduler


EMULATED_SPACE = 0x1000_0000_0000_0000
"""Emulated device addresses lie above this, where no CPU address does: host aliases from ALIAS_BASE (split mode),
device memory from DEVICE_BASE, each device DEVICE_STRIDE apart."""
ALIAS_BASE = 0x3000_0000_0000_0000
DEVICE_BASE = 0x5000_0000_0000_0000
DEVICE_STRIDE = 1 << 44
GUARD_BYTES = 1 << 20
"""Unmapped bytes after every emulated mapping: an access running past an allocation faults, as on a GPU it
often does."""


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
        found = self.lookup(address, nbytes) or self._across(address, nbytes)
        if found is None:
            raise IllegalAddress(f"emulated device {self.device}: illegal address 0x{address:x} (+{nbytes} bytes) is "
                                 f"not mapped on this device; {self._why(address)}")
        return found[0]

    def _why(self, address: int) -> str:
        """What an unmapped access most likely is, by where it falls: just past the mapping below it (an index or
        size out of range), elsewhere in the device-memory or host-alias space, or a CPU address."""
        below = self.ranges.at_or_below(address)
        if below is not None and address < below.end + GUARD_BYTES:
            what = "device memory" if below.value.kind is MappingKind.DEVICE_MEMORY else "a host alias"
            where = "runs past" if address < below.end else f"lies {address - below.end} bytes past"
            return (f"it {where} the end of {what} at 0x{below.start:x} (+{below.nbytes} bytes): an index or size "
                    f"out of range")
        if address >= DEVICE_BASE:
            return ("no allocation of this device holds it: an index or size far out of range, freed memory, or "
                    "another device's memory")
        if address >= ALIAS_BASE:
            return ("no host registration of this device holds it: unregistered or freed host memory, an index out "
                    "of range, or another device's alias")
        return ("it is a CPU address: kernels reach host memory only through the device alias of a registration "
                "(pageable or unregistered memory, or a CPU address passed where the alias was needed)")

    def _across(self, address: int, nbytes: int) -> tuple[int, Mapping] | None:
        """An access running from one mapping into the next ones, as a GPU reads across adjacent mappings (a buffer
        registered in chunks, under unified addressing): found where each next mapping starts where the last ends and
        its backing continues the last's, so the bytes are one run of host memory."""
        entry = self.ranges.find(address, 1)
        if entry is None:
            return None
        first, end = entry, address + nbytes
        while entry.end < end:
            following = self.ranges.find(entry.end, 1)
            if following is None or following.start != entry.end or \
                    following.value.backing != entry.value.backing + entry.nbytes:
                return None
            entry = following
        return first.value.backing + (address - first.start), first.value


class DeviceMemory:
    """What an emulated kernel can touch: every access goes through its device's address map."""

    def __init__(self, address_map: AddressMap) -> None:
        self._map = address_map
        self.device = address_map.device

    def view(self, address: int, nbytes: int, *, align: int = 1) -> np.ndarray:
        """A writable uint8 array over [address, address + nbytes) as this device sees it; ``align`` is the width of
        the vector accesses the kernel makes there (a GPU faults on a misaligned vector access)."""
        if int(address) % align:
            raise MisalignedAddress(f"emulated device {self.device}: misaligned address 0x{int(address):x} for a "
                                    f"{align}-byte vector access")
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        backing = self._map.translate(int(address), nbytes)
        return np.ctypeslib.as_array(osmem.byte_array(backing, nbytes))

    def read(self, address: int, nbytes: int) -> bytes:
        return self.view(address, nbytes).tobytes()

    def write(self, address: int, data: bytes | np.ndarray) -> None:
        source = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else data.view(np.uint8)
        self.view(address, source.size)[:] = source.reshape(-1)


class Marker:
    """The point an event recorded in a stream: done once the stream's work before it has run."""

    def __init__(self, stream: EmulatedStream) -> None:
        self.stream = stream
        self.done = False
        self.timestamp: float | None = None

    def __call__(self) -> None:
        self.done, self.timestamp = True, time.perf_counter()


class WaitOp:
    """A stream's wait on a marker: the stream cannot run past it until the marker is done."""

    def __init__(self, marker: Marker) -> None:
        self.marker = marker

    def __call__(self) -> None:
        pass


class WaitValueOp:
    """A stream's wait on a memory value (cuStreamWaitValue64, GEQ): the stream cannot run past it until the uint64
    ``read()`` returns reaches ``value``. Nothing says which stream will write it, so a lazy schedule that meets one
    runs any ready stream."""

    def __init__(self, read: Callable[[], int], value: int) -> None:
        self.read, self.value = read, value

    @property
    def ready(self) -> bool:
        return self.read() >= self.value

    def __call__(self) -> None:
        pass


class Busy:
    """A long kernel (``torch.cuda._sleep``): it holds its stream for ``steps`` scheduler steps, while other streams
    run."""

    def __init__(self, steps: int) -> None:
        self.remaining = steps

    def __call__(self) -> None:
        pass


class Running:
    """A kernel that runs in phases (a Python generator, one phase per scheduler step): it holds its stream while
    other streams run between its phases, so what it signals mid-kernel (a layer's counter) can be observed before
    it ends, as on a GPU."""

    def __init__(self, phases: Iterator[None]) -> None:
        self.phases = phases

    def __call__(self) -> None:
        pass


Op = Callable[[], None]


class EmulatedStream(Stream):
    """An in-order queue of operations on one device; the scheduler runs them when their waits allow."""

    def __init__(self, scheduler: Scheduler, device: int, handle: int) -> None:
        self.device, self.handle = device, handle
        self.scheduler = scheduler
        self.pending: collections.deque[Op] = collections.deque()
        self._captured: list[Op] | None = None
        self.closed = False

    def enqueue(self, op: Op) -> None:
        with self.scheduler.lock:
            self.scheduler.check_alive(self.device)
            if self.closed:
                raise RuntimeCallError("cudaStreamQuery", "cudaErrorInvalidResourceHandle",
                                       f"stream {self.handle} on emulated device {self.device} is destroyed")
            if self._captured is not None:
                self._captured.append(op)
                return
            if not self.pending and isinstance(op, Marker):   # an event on an idle stream is done at once, as on a GPU
                op()
                return
            self.pending.append(op)
            self.scheduler.advance()

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

    def end_capture(self) -> EmulatedGraph:
        if self._captured is None:
            raise RuntimeCallError("cudaStreamEndCapture", "cudaErrorIllegalState", "stream is not capturing")
        ops, self._captured = self._captured, None
        return EmulatedGraph(self.device, ops)

    def synchronize(self) -> None:
        """A destroyed stream's handle is invalid (CUDA may crash on it; the H200 segfaulted): raise instead."""
        with self.scheduler.lock:
            if self.closed:
                raise RuntimeCallError("cudaStreamSynchronize", "cudaErrorInvalidResourceHandle",
                                       f"stream {self.handle} on emulated device {self.device} is destroyed")
            self.scheduler.check_not_capturing(self.device, "cudaStreamSynchronize")
            self.scheduler.run_until(lambda: not self.pending, self, "cudaStreamSynchronize")

    def wait(self, event: Event) -> None:
        if not isinstance(event, EmulatedEvent):
            raise WrongRuntime(f"an emulated stream waits on emulated events, not {event!r}")
        if event.scheduler is not self.scheduler:
            raise WrongRuntime(f"{event!r} belongs to another emulated runtime than {self!r}")
        event._check_open()
        marker = event.marker
        if marker is not None:
            self.enqueue(WaitOp(marker))

    def close(self) -> None:
        """cudaStreamDestroy: queued work still completes; the handle is gone at once."""
        self.closed = True

    def __repr__(self) -> str:
        return f"<EmulatedStream {self.handle} of device {self.device}>"


class EmulatedGraph(Graph):
    """The captured operations; each replay runs them again against memory as it is then."""

    def __init__(self, device: int, ops: list[Op]) -> None:
        self.device, self._ops = device, ops
        self.closed = False

    def launch(self, stream: Stream) -> None:
        if not isinstance(stream, EmulatedStream):
            raise WrongRuntime(f"an emulated graph launches on an emulated stream, not {stream!r}")
        if self.closed:
            raise RuntimeCallError("cudaGraphLaunch", "cudaErrorInvalidResourceHandle", "this graph is destroyed")
        for op in self._ops:
            stream.enqueue(op)

    def close(self) -> None:
        self._ops, self.closed = [], True


class EmulatedEvent(Event):
    def __init__(self, scheduler: Scheduler, device: int, timing: bool = False) -> None:
        self.scheduler, self.device, self.timing = scheduler, device, timing
        self.marker: Marker | None = None
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise InvalidArgument("this emulated event is closed")

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, EmulatedStream):
            raise WrongRuntime(f"an emulated event can only be recorded on an emulated stream, not {stream!r}")
        if stream.scheduler is not self.scheduler:
            raise WrongRuntime(f"{stream!r} belongs to another emulated runtime than this event")
        if stream.device != self.device:  # as cudaEventRecord
            raise RuntimeCallError("cudaEventRecord", "cudaErrorInvalidResourceHandle",
                                   f"an event of device {self.device} cannot be recorded on a stream of device "
                                   f"{stream.device}")
        self._check_open()
        marker = Marker(stream)
        stream.enqueue(marker)
        if not stream.capturing:
            self.marker = marker

    def query(self) -> bool:
        """Like cudaEventQuery: never blocks; the emulator makes some progress when observed."""
        self._check_open()
        marker = self.marker
        with self.scheduler.lock:
            self.scheduler.check_alive(self.device)
            if marker is None:
                return True
            self.scheduler.progress(marker.stream)
            self.scheduler.check_alive(self.device)
            return marker.done

    def synchronize(self) -> None:
        self._check_open()
        marker = self.marker
        if marker is None:
            self.scheduler.check_alive(self.device)
            return
        with self.scheduler.lock:
            self.scheduler.check_not_capturing(self.device, "cudaEventSynchronize")
            self.scheduler.run_until(lambda: marker.done, marker.stream, "cudaEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, EmulatedEvent):
            raise WrongRuntime("elapsed_ms needs two emulated events")
        self._check_open()
        end._check_open()
        if not (self.timing and end.timing):
            raise RuntimeCallError("cudaEventElapsedTime", "cudaErrorInvalidResourceHandle",
                                   "both events must be created with timing=True")
        first, last = self.marker, end.marker
        if any(m is not None and not m.done for m in (first, last)):  # as CUDA: the caller waits first
            raise RuntimeCallError("cudaEventElapsedTime", "cudaErrorNotReady",
                                   "an event has not completed yet: synchronize it before timing")
        if first is None or last is None or first.timestamp is None or last.timestamp is None:
            raise RuntimeCallError("cudaEventElapsedTime", "cudaErrorInvalidResourceHandle",
                                   "both events must have been recorded")
        return (last.timestamp - first.timestamp) * 1e3

    def _close(self) -> None:
        """Idempotent; later uses raise (on CUDA the handle may be serving another event by then)."""
        self.closed = True
