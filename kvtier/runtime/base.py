"""The runtime interface every platform backend implements, and the rules they share.

A backend (``cuda``, ``emulated``) fills in the underscore hooks; the public methods here keep the bookkeeping that
must be identical everywhere: which host ranges kvtier registered, that nothing is registered twice, that
unregistering uses each registration's own CPU address, that resolving an alias for a device leaves the caller's
current device alone, and that an alias is looked up once per registration and device.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from dataclasses import dataclass
from typing import Iterator

from kvtier.errors import InvalidDevice, RegistrationError
from kvtier.runtime.ranges import Range, RangeIndex


class MemoryType(enum.Enum):
    UNREGISTERED = "unregistered"
    HOST = "host"
    DEVICE = "device"
    MANAGED = "managed"


@dataclass(frozen=True)
class DeviceAttributes:
    name: str
    compute_capability: tuple[int, int]
    total_memory: int
    multiprocessors: int
    can_use_host_pointer_for_registered_mem: bool
    unified_addressing: bool
    can_map_host_memory: bool
    pageable_memory_access: bool
    host_register_supported: bool


@dataclass(frozen=True)
class PointerAttributes:
    """What the runtime knows of an address; ``device_pointer`` is the alias for the current device."""

    type: MemoryType
    device: int | None
    device_pointer: int | None
    host_pointer: int | None


class HostRegisterFlags(enum.IntFlag):
    """cudaHostRegister / hipHostRegister flags (same values on both)."""

    DEFAULT = 0
    PORTABLE = 1
    MAPPED = 2


PORTABLE_MAPPED = HostRegisterFlags.PORTABLE | HostRegisterFlags.MAPPED


class HostMemoryKind(enum.Enum):
    REGISTERED = "registered"
    PINNED = "pinned"


class Stream:
    """An in-order queue of work on one device. ``handle`` is the native handle (0 for none)."""

    device: int
    handle: int

    def synchronize(self) -> None:
        raise NotImplementedError("need Stream.synchronize")

    def wait(self, event: "Event") -> None:
        raise NotImplementedError("need Stream.wait")

    def begin_capture(self) -> None:
        raise NotImplementedError("need Stream.begin_capture")

    def end_capture(self) -> Graph:
        raise NotImplementedError("need Stream.end_capture")

    @property
    def capturing(self) -> bool:
        raise NotImplementedError("need Stream.capturing")

    def close(self) -> None:
        raise NotImplementedError("need Stream.close")


class Graph:
    """Work captured from a stream, replayed with :meth:`launch`; replays read memory as it is at replay time."""

    def launch(self, stream: "Stream") -> None:
        raise NotImplementedError("need Graph.launch")

    def close(self) -> None:
        raise NotImplementedError("need Graph.close")


class Event:
    """A marker in a stream; ``elapsed_ms`` gives the device time between two recorded events."""

    def record(self, stream: Stream) -> None:
        raise NotImplementedError("need Event.record")

    def query(self) -> bool:
        raise NotImplementedError("need Event.query")

    def synchronize(self) -> None:
        raise NotImplementedError("need Event.synchronize")

    def elapsed_ms(self, end: "Event") -> float:
        raise NotImplementedError("need Event.elapsed_ms")

    def close(self) -> None:
        raise NotImplementedError("need Event.close")


class Runtime:
    """One GPU platform: devices, host memory registration, device memory, copies, streams and events."""

    name = "abstract"
    #: the emulator runs Python kernels; compiled-kernel runtimes launch modules instead
    runs_python_kernels = False

    def __init__(self) -> None:
        self._host = RangeIndex[HostMemoryKind]()
        self._lock = threading.RLock()

    # -- devices -----------------------------------------------------------------------------------------------
    def device_count(self) -> int:
        raise NotImplementedError("need device_count")

    def current_device(self) -> int:
        raise NotImplementedError("need current_device")

    def set_device(self, device: int) -> None:
        raise NotImplementedError("need set_device")

    def device_attributes(self, device: int) -> DeviceAttributes:
        raise NotImplementedError("need device_attributes")

    def check_device(self, device: int) -> int:
        count = self.device_count()
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
            raise InvalidDevice(f"{self.name}: no device {device!r} (this runtime has {count})")
        return device

    @contextlib.contextmanager
    def using_device(self, device: int) -> Iterator[int]:
        """Make ``device`` current inside the block and restore the caller's device after, also on error."""
        self.check_device(device)
        previous = self.current_device()
        if previous != device:
            self.set_device(device)
        try:
            yield device
        finally:
            if previous != device:
                self.set_device(previous)

    def synchronize(self, device: int | None = None) -> None:
        raise NotImplementedError("need synchronize")

    # -- host memory ---------------------------------------------------------------------------------------------
    def host_alloc(self, nbytes: int) -> int:
        """Pinned, mapped, portable host memory; returns its CPU address."""
        if nbytes <= 0:
            raise ValueError(f"host_alloc: size must be positive, got {nbytes}")
        with self._lock:
            address = self._host_alloc(nbytes)
            self._host.add(address, nbytes, HostMemoryKind.PINNED)
        return address

    def host_free(self, address: int) -> None:
        with self._lock:
            self._own_range(address, HostMemoryKind.PINNED, "host_free")
            self._host_free(address)
            self._host.pop(address)

    def host_register(self, address: int, nbytes: int, flags: HostRegisterFlags = PORTABLE_MAPPED) -> None:
        """Register [address, address + nbytes); the default (portable, mapped) makes it usable on every device."""
        if nbytes <= 0:
            raise RegistrationError(f"host_register: size must be positive, got {nbytes}")
        with self._lock:
            clash = self.host_overlap(address, nbytes)
            if clash is not None:
                raise RegistrationError(
                    f"host_register: [0x{address:x}, +{nbytes}) is already registered "
                    f"(overlaps the {clash.value.value} range at 0x{clash.start:x}, {clash.nbytes} bytes)"
                )
            self._host_register(address, nbytes, HostRegisterFlags(flags))
            self._host.add(address, nbytes, HostMemoryKind.REGISTERED)

    def host_unregister(self, address: int) -> None:
        """Unregister by the CPU address the range was registered with: never by an alias, never mid-range."""
        with self._lock:
            self._own_range(address, HostMemoryKind.REGISTERED, "host_unregister")
            self._host_unregister(address)
            self._host.pop(address)

    def host_range(self, address: int, nbytes: int = 1) -> Range[HostMemoryKind] | None:
        """The kvtier-registered or kvtier-allocated host range holding the address, if any."""
        with self._lock:
            return self._host.find(address, nbytes)

    def host_overlap(self, address: int, nbytes: int) -> Range[HostMemoryKind] | None:
        """A kvtier-registered or kvtier-allocated host range overlapping [address, address + nbytes), if any."""
        with self._lock:
            return self._host.overlapping(address, nbytes)

    def host_get_device_pointer(self, address: int, device: int) -> int:
        """The alias of pinned/registered host memory valid on ``device``; the current device is unchanged."""
        self.check_device(device)
        with self._lock:
            known = self._host.find(address)
            if known is None:
                with self.using_device(device):
                    return self._host_get_device_pointer(address)
            if device not in known.aliases:
                with self.using_device(device):
                    known.aliases[device] = self._host_get_device_pointer(known.start)
            return known.aliases[device] + (address - known.start)

    def _own_range(self, address: int, kind: HostMemoryKind, call: str) -> None:
        entry = self._host.find(address)
        if entry is None or entry.start != address or entry.value is not kind:
            where = "not a range kvtier knows" if entry is None else (
                f"inside the {entry.value.value} range at 0x{entry.start:x}" if entry.start != address
                else f"a {entry.value.value} range")
            raise RegistrationError(f"{call}: 0x{address:x} is {where}; pass the CPU address the {kind.value} "
                                    f"range started at")

    # -- pointers, device memory, copies ---------------------------------------------------------------------------
    def pointer_attributes(self, address: int) -> PointerAttributes:
        raise NotImplementedError("need pointer_attributes")

    def device_alloc(self, nbytes: int, device: int) -> int:
        raise NotImplementedError("need device_alloc")

    def device_free(self, address: int) -> None:
        raise NotImplementedError("need device_free")

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        raise NotImplementedError("need memcpy")

    def memcpy_async(self, dst: int, src: int, nbytes: int, *, stream: Stream) -> None:
        raise NotImplementedError("need memcpy_async")

    def memcpy_batch_async(self, dsts: list[int], srcs: list[int], sizes: list[int], *, stream: Stream) -> None:
        """Many copies in one call where the platform batches them; here, one memcpy_async each."""
        for dst, src, nbytes in zip(dsts, srcs, sizes, strict=True):
            self.memcpy_async(dst, src, nbytes, stream=stream)

    def create_stream(self, device: int | None = None) -> Stream:
        raise NotImplementedError("need create_stream")

    def create_event(self, device: int | None = None) -> Event:
        raise NotImplementedError("need create_event")

    # -- hooks -----------------------------------------------------------------------------------------------------
    def _host_alloc(self, nbytes: int) -> int:
        raise NotImplementedError("need host_alloc")

    def _host_free(self, address: int) -> None:
        raise NotImplementedError("need host_free")

    def _host_register(self, address: int, nbytes: int, flags: HostRegisterFlags) -> None:
        raise NotImplementedError("need host_register")

    def _host_unregister(self, address: int) -> None:
        raise NotImplementedError("need host_unregister")

    def _host_get_device_pointer(self, address: int) -> int:
        raise NotImplementedError("need host_get_device_pointer")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"
