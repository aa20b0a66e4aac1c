"""The runtime interface: a new platform subclasses :class:`Runtime`, :class:`Stream`, :class:`Event` and
:class:`Graph` and writes these primitives, the abstract methods (a subclass missing one cannot be instantiated: the
TypeError names it). Devices are ints the base has checked; a failing native call raises ``RuntimeCallError`` naming
the call and its error (one ``check`` function per native API, as ``cuda.py`` and ``hip.py`` do).

- ``Runtime.device_count()`` → how many devices the platform sees (an int; 0 when none).
- ``Runtime.current_device()`` → the calling thread's current device.
- ``Runtime.set_device(device)`` makes ``device`` current for the calling thread; InvalidDevice if there is none.
- ``Runtime.device_attributes(device)`` → the device's :class:`DeviceAttributes`.
- ``Runtime._synchronize(device)`` waits for all work queued on ``device``; raises the fault that work hit.
- ``Runtime._host_alloc(nbytes)`` → the CPU address of new pinned, mapped, portable host memory.
- ``Runtime._host_free(address)`` frees a ``_host_alloc`` range after the devices' queued work (as cudaFreeHost).
- ``Runtime._host_register(address, nbytes, flags)`` pins and maps existing host memory (``HostRegisterFlags``).
- ``Runtime._host_unregister(address)`` undoes ``_host_register`` of the range starting at ``address``.
- ``Runtime._host_get_device_pointer(address)`` → the current device's alias of registered or pinned host memory.
- ``Runtime.pointer_attributes(address)`` → :class:`PointerAttributes` (``UNREGISTERED`` for memory it does not know).
- ``Runtime.device_alloc(nbytes, device)`` → the address of ``nbytes`` of new device memory on ``device``.
- ``Runtime.device_free(address)`` frees a ``device_alloc`` address after the device's queued work (as cudaFree).
- ``Runtime._memcpy(dst, src, nbytes)`` copies between typed addresses on the legacy stream, as cudaMemcpy.
- ``Runtime._memcpy_async(dst, src, nbytes, stream)`` queues a copy between typed addresses on ``stream``.
- ``Runtime.create_stream(device)`` → a new non-blocking :class:`Stream` of ``device`` (None: the current device).
- ``Runtime.create_event(device, *, timing)`` → a new :class:`Event` of ``device``, timed when ``timing``.
- ``Runtime.legacy_stream(device)`` → the device's legacy default stream, where ``_memcpy`` queues.
- ``Runtime.as_stream(stream)`` → this runtime's :class:`Stream` for ``stream``; WrongRuntime for a foreign one.
- ``Runtime.as_event(event)`` → this runtime's :class:`Event` for ``event``; WrongRuntime for a foreign one.
- ``Runtime._load_program(spec, device)`` → a :class:`Program` of ``spec``'s kernels loaded on ``device``.
- ``Runtime._launch(program, name, grid, block, args, stream, shared_bytes)`` queues one kernel launch on ``stream``.
- ``Stream.synchronize()`` waits for the stream's queued work.
- ``Stream.wait(event)`` makes later work on the stream wait for ``event`` (on the device; returns at once).
- ``Stream.begin_capture()`` starts capturing the stream's work into a graph instead of running it.
- ``Stream.end_capture()`` → the :class:`Graph` of the work captured since ``begin_capture``.
- ``Stream.capturing`` (a property) → whether the stream is capturing now.
- ``Stream.close()`` releases an owned stream's handle (a borrowed one is left alone); idempotent.
- ``Event.record(stream)`` marks the current end of ``stream``'s queued work.
- ``Event.query()`` → whether the recorded work has finished (True when never recorded); never blocks.
- ``Event.synchronize()`` waits for the recorded work.
- ``Event.elapsed_ms(end)`` → device milliseconds from this event to ``end`` (both timed and finished).
- ``Event._close()`` releases the handle; later uses raise InvalidArgument.
- ``Graph.launch(stream)`` queues one replay of the captured work on ``stream``.
- ``Graph.close()`` releases the graph; later launches raise.

Optional hooks, with defaults here: ``_current_stream`` (the legacy stream), ``supports_wait_value`` (no) and
``_wait_value``, ``_memcpy_run_sets`` / ``_memcpy_runs`` / ``_memcpy_2d_async`` (one ``_memcpy_async`` per copy),
``allocation_end`` (kvtier's host ranges only), ``after_device_work``.

The public methods keep the bookkeeping that must be identical everywhere: which host ranges kvtier registered, that
nothing is registered twice, that unregistering uses each registration's own CPU address, that resolving an alias for
a device leaves the caller's current device alone, that an alias is looked up once per registration and device, that
copies and kernel operands are typed addresses (never bare integers), and that a program is loaded once per device.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import numbers
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvtier.address import Address, CpuAddress, DeviceAddress
from kvtier.checks import Choice
from kvtier.errors import (
    AddressDomainError,
    InvalidArgument,
    InvalidDevice,
    KvtierError,
    RegistrationError,
    WrongDeviceError,
    capture_refused,
)
from kvtier.locks import named_lock
from kvtier.runtime.program import KernelArg, Program, ProgramSpec
from kvtier.runtime.ranges import Range, RangeIndex


class MemoryType(enum.Enum):
    UNREGISTERED = "unregistered"
    HOST = "host"
    DEVICE = "device"
    MANAGED = "managed"


class HostKind(Choice):
    """Where host memory comes from. The runtime records only PINNED (its own allocation) and REGISTERED ranges."""

    __what__ = "host memory kind"

    PINNED = "pinned"
    REGISTERED = "registered"
    SHM = "shm"
    HUGETLB = "hugetlb"
    PAGEABLE = "pageable"


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
    arch: str = ""
    """The compiler target of the device's kernels (``sm_90``, ``gfx942``); empty where there is none."""


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


class Stream(abc.ABC):
    """An in-order queue of work on one device. ``handle`` is the native handle (0 for the legacy stream)."""

    device: int
    handle: int

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for the stream's queued work."""

    @abc.abstractmethod
    def wait(self, event: Event) -> None:
        """Make later work on the stream wait for ``event`` (on the device)."""

    @abc.abstractmethod
    def begin_capture(self) -> None:
        """Capture the stream's work into a graph instead of running it."""

    @abc.abstractmethod
    def end_capture(self) -> Graph:
        """The graph of the work captured since :meth:`begin_capture`."""

    @property
    @abc.abstractmethod
    def capturing(self) -> bool:
        """Whether the stream is capturing now."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release an owned stream's handle (a borrowed one is left alone); idempotent."""


class Graph(abc.ABC):
    """Work captured from a stream, replayed with :meth:`launch`; replays read memory as it is at replay time."""

    @abc.abstractmethod
    def launch(self, stream: Stream) -> None:
        """Queue one replay on ``stream``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the graph; later launches raise."""


class Event(abc.ABC):
    """A marker in a stream; ``elapsed_ms`` gives the device time between two recorded events. ``close()`` releases
    it and is idempotent; a closed event refuses every later use (record, query, synchronize, elapsed_ms, a stream's
    wait), since on CUDA its handle may already serve another event. An event with a ``keeper`` (kvtier's name for
    the object that owns it, e.g. a Transfer handing it out) ignores ``close()``: its keeper releases it."""

    device: int
    keeper: str | None = None

    @abc.abstractmethod
    def record(self, stream: Stream) -> None:
        """Mark the current end of ``stream``'s queued work."""

    @abc.abstractmethod
    def query(self) -> bool:
        """Whether the recorded work has finished (True when never recorded); never blocks."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for the recorded work."""

    @abc.abstractmethod
    def elapsed_ms(self, end: Event) -> float:
        """Device milliseconds from this event to ``end``."""

    def close(self) -> None:
        if self.keeper is None:
            self._close()

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the handle; every later use raises."""


class _Kept(Exception):
    """A release whose wait a capture refused."""


_KEPT_RELEASES: list[tuple[Any, Callable[[], None]]] = []
_KEPT_LOCK = named_lock("runtime.kept_releases")
"""Releases :meth:`Runtime.after_device_work` could not make yet (a stream was capturing), with their runtime."""


class RunSet(NamedTuple):
    """Copies between two typed bases, checked: ``sizes[i]`` bytes from ``src + src_offsets[i]`` to
    ``dst + dst_offsets[i]`` (int64 arrays of one length)."""

    dst: Address
    dst_offsets: np.ndarray
    src: Address
    src_offsets: np.ndarray
    sizes: np.ndarray


class Runtime(abc.ABC):
    """One GPU platform: devices, host memory registration, device memory, copies, streams, events and kernels."""

    name = "abstract"
    torch_device: str | None = None
    """The ``torch.device`` type of this platform's GPU tensors (``"cuda"`` for CUDA and for ROCm builds of torch,
    which keep CUDA's names); None where torch has no tensors on it (the emulator)."""

    def __init__(self) -> None:
        self._host = RangeIndex[HostKind]()
        self._lock = named_lock("runtime", fork_safe=True)
        self._programs: dict[tuple[str, int], Program] = {}
        self._stream_override = threading.local()

    # -- devices -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices the platform sees."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """The calling thread's current device."""

    @abc.abstractmethod
    def set_device(self, device: int) -> None:
        """Make ``device`` current for the calling thread (InvalidDevice if there is none)."""

    @abc.abstractmethod
    def device_attributes(self, device: int) -> DeviceAttributes:
        """What the device is and can do."""

    def check_device(self, device: int) -> int:
        """``device`` as an int (numpy integers too) if this runtime has it."""
        count = self.device_count()
        if type(device) is int and 0 <= device < count:
            return device
        if isinstance(device, (bool, np.bool_)) or not isinstance(device, numbers.Integral) or \
                not 0 <= device < count:
            raise InvalidDevice(f"{self.name}: no device {device!r} (this runtime has {count})")
        return int(device)

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
        """Wait for all work queued on ``device`` (default: the current one), then make the releases a capture kept
        back (see :meth:`after_device_work`): waits are allowed again."""
        self._synchronize(self.current_device() if device is None else self.check_device(device))
        self.release_kept()

    @abc.abstractmethod
    def _synchronize(self, device: int) -> None:
        """Wait for all work queued on ``device``; raise the fault that work hit."""

    # -- host memory ---------------------------------------------------------------------------------------------
    def host_alloc(self, nbytes: int) -> int:
        """Pinned, mapped, portable host memory; returns its CPU address."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"host_alloc: size must be a positive int, got {nbytes!r}")
        with self._lock:
            address = self._host_alloc(nbytes)
            self._host.add(address, nbytes, HostKind.PINNED)
        return address

    def after_device_work(self, release: Callable[[], None]) -> None:
        """Run ``release`` (memory given back) once every device has finished the work queued so far, which may
        still read that memory. A device an earlier fault ruined runs nothing more and is not waited for. Where a
        stream captures, the wait is refused (and must not be made: it would invalidate the capture): the release is
        kept, and made at a later call here once the waits are allowed again."""
        with _KEPT_LOCK:
            waiting = [kept for runtime, kept in _KEPT_RELEASES if runtime is self]
            _KEPT_RELEASES[:] = [(runtime, kept) for runtime, kept in _KEPT_RELEASES if runtime is not self]
        failed: Exception | None = None
        for each in (*waiting, release):
            try:
                for device in range(self.device_count()):
                    try:
                        self.synchronize(device)
                    except KvtierError as error:   # a faulted device runs nothing more: not waited for
                        if capture_refused(error):
                            raise _Kept from None
            except _Kept:
                with _KEPT_LOCK:
                    _KEPT_RELEASES.append((self, each))
                continue
            try:
                each()
            except Exception as error:  # noqa: BLE001 (the others are still made; the first failure is raised)
                failed = failed or error
        if failed is not None:
            raise failed

    def release_kept(self) -> None:
        """Make the releases a capture kept back (see :meth:`after_device_work`): called after every successful
        device synchronise, when waits are allowed again."""
        with _KEPT_LOCK:
            if not any(runtime is self for runtime, _ in _KEPT_RELEASES):
                return
        self.after_device_work(lambda: None)

    def host_free(self, address: int) -> None:
        with self._lock:
            self._own_range(address, HostKind.PINNED, "host_free")
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
            self._host.add(address, nbytes, HostKind.REGISTERED)

    def host_unregister(self, address: int) -> None:
        """Unregister by the CPU address the range was registered with: never by an alias, never mid-range."""
        with self._lock:
            self._own_range(address, HostKind.REGISTERED, "host_unregister")
            self._host_unregister(address)
            self._host.pop(address)

    def host_range(self, address: int, nbytes: int = 1) -> Range[HostKind] | None:
        """The kvtier-registered or kvtier-allocated host range holding the address, if any."""
        with self._lock:
            return self._host.find(address, nbytes)

    @property
    def host_generation(self) -> int:
        """Changes whenever a kvtier host range is added or removed: a resolution of an address inside one (its
        alias, its span) made at one generation holds while this is unchanged."""
        with self._lock:
            return self._host.generation

    def allocation_end(self, address: int) -> int | None:
        """Where the allocation or registration holding ``address`` ends, where the runtime knows it (kvtier's host
        ranges here; device allocations too where the platform tells), else None: what bounds a raw pointer that
        came with no size (an entry of someone else's pointer table)."""
        found = self.host_range(address)
        return None if found is None else found.end

    def host_overlap(self, address: int, nbytes: int) -> Range[HostKind] | None:
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

    def _own_range(self, address: int, kind: HostKind, call: str) -> None:
        entry = self._host.find(address)
        if entry is None or entry.start != address or entry.value is not kind:
            where = "not a range kvtier knows" if entry is None else (
                f"inside the {entry.value.value} range at 0x{entry.start:x}" if entry.start != address
                else f"a {entry.value.value} range")
            raise RegistrationError(f"{call}: 0x{address:x} is {where}; pass the CPU address the {kind.value} "
                                    f"range started at")

    # -- pointers, device memory, copies ---------------------------------------------------------------------------
    @abc.abstractmethod
    def pointer_attributes(self, address: int) -> PointerAttributes:
        """What the platform knows of ``address`` (``UNREGISTERED`` for memory it does not know)."""

    @abc.abstractmethod
    def device_alloc(self, nbytes: int, device: int) -> int:
        """The address of ``nbytes`` of new memory on ``device``."""

    @abc.abstractmethod
    def device_free(self, address: int) -> None:
        """Free device memory; like cudaFree it first waits for every queued operation on the device."""

    def memcpy(self, dst: Address, src: Address, nbytes: int) -> None:
        """A copy on the legacy default stream. From pageable host memory to a device it may return before the bytes
        land (as cudaMemcpy does): order device work after the caller's stream, or synchronize, before reading."""
        if self._copy_size(dst, src, nbytes, "memcpy"):
            self._memcpy(dst, src, nbytes)

    def memcpy_async(self, dst: Address, src: Address, nbytes: int, *, stream: Stream) -> None:
        if self._copy_size(dst, src, nbytes, "memcpy_async"):
            self._memcpy_async(dst, src, nbytes, stream)

    def memcpy_runs_async(self, dst: Address, dst_offsets: Any, src: Address, src_offsets: Any, sizes: Any, *,
                          stream: Stream, batched: bool = False) -> None:
        """Many copies between two typed bases: ``sizes[i]`` bytes from ``src + src_offsets[i]`` to
        ``dst + dst_offsets[i]``. Runs of equal size, equally spaced on both sides (one layer of consecutive pages in
        a page-major host layout) go as one strided copy each (cudaMemcpy2DAsync: the copy engines move 32 KiB rows
        at the link's ceiling, where one call per row is bound by the calls); the rest go one memcpy_async each, or
        with ``batched`` in the platform's batched copy (cudaMemcpyBatchAsync) where it has one. Offsets
        keep the domain of their base: there is no raw address. The copies of one call run in no defined order (a
        batch does not order its entries), so no two may write the same bytes; callers taking indices from users
        check that (the compat ``*_direct`` functions refuse repeated destinations)."""
        self.memcpy_run_sets_async([(dst, dst_offsets, src, src_offsets, sizes)], stream=stream, batched=batched)

    def memcpy_run_sets_async(self, sets: Sequence[tuple[Address, Any, Address, Any, Any]], *, stream: Stream,
                              batched: bool = False) -> None:
        """:meth:`memcpy_runs_async` over several pairs of bases at once, ``(dst, dst_offsets, src, src_offsets,
        sizes)`` each (a layer's K and V): with ``batched``, one batch for all of them, so a call pays the batch's
        fixed costs (a driver call, a detour off the legacy stream) once. Every set's arguments are checked before
        any copy is queued, and on the emulator every copy's memory too. CUDA's driver checks memory as each call is
        made, so a copy it refuses can leave the copies before it queued: kvtier's callers (the engine, the compat
        layer) check every copy's bounds before they call."""
        checked = [self._run_set(*copies) for copies in sets]
        self._memcpy_run_sets(checked, stream, batched)

    def _run_set(self, dst: Address, dst_offsets: Any, src: Address, src_offsets: Any, sizes: Any) -> RunSet:
        self._copy_size(dst, src, 0, "memcpy_runs_async")
        given = [np.asarray(a) for a in (dst_offsets, src_offsets, sizes)]
        for name, array in zip(("destination offsets", "source offsets", "sizes"), given, strict=True):
            if array.size and array.dtype.kind not in "iu":
                raise InvalidArgument(f"memcpy_runs_async: {name} must be integers, got {array.dtype} "
                                      f"({array.reshape(-1)[:3].tolist()}...)")
        arrays = [a.astype(np.int64, copy=False).reshape(-1) for a in given]
        if not arrays[0].size == arrays[1].size == arrays[2].size:
            raise InvalidArgument(f"memcpy_runs_async: {arrays[0].size} destination offsets, {arrays[1].size} source "
                                  f"offsets and {arrays[2].size} sizes")
        if arrays[2].size and (min(a.min() for a in arrays) < 0):
            raise InvalidArgument("memcpy_runs_async: offsets and sizes must be non-negative")
        return RunSet(dst, arrays[0], src, arrays[1], arrays[2])

    def _memcpy_run_sets(self, sets: list[RunSet], stream: Stream, batched: bool) -> None:
        for run_set in sets:
            self._memcpy_runs(*run_set, stream, batched)

    def segments(self, base: Address, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
        """Per copy, which host registration (or allocation) of ``base``'s span it lies in, when ``base`` is a CPU
        address over several: one strided copy may not cross from one to the next (cudaMemcpy2DAsync refuses it
        with cudaErrorInvalidValue, as a single copy would). None when there is nothing to cross."""
        if not isinstance(base, CpuAddress) or not offsets.size:
            return None
        lo, hi = int(offsets.min()), int((offsets + sizes).max())
        edges = self.host_edges(base.value + lo, base.value + hi)
        if not edges:
            return None
        return np.searchsorted(np.asarray(edges, dtype=np.int64) - base.value, offsets, side="right")

    def host_edges(self, start: int, end: int) -> list[int]:
        """CPU addresses strictly inside (start, end) where one kvtier host registration or allocation ends or the
        next begins: no single copy may cross one."""
        with self._lock:
            return self._host.edges(start, end)

    def groups(self, dst: Address, dst_offsets: np.ndarray, src: Address, src_offsets: np.ndarray,
               sizes: np.ndarray) -> np.ndarray:
        """:func:`strided_groups` that never cross a host registration boundary on either side."""
        return strided_groups(dst_offsets, src_offsets, sizes, self.segments(dst, dst_offsets, sizes),
                              self.segments(src, src_offsets, sizes))

    def _memcpy_runs(self, dst: Address, dst_offsets: np.ndarray, src: Address, src_offsets: np.ndarray,
                     sizes: np.ndarray, stream: Stream, batched: bool) -> None:
        for first, count, dst_pitch, src_pitch in self.groups(dst, dst_offsets, src, src_offsets, sizes).tolist():
            width = int(sizes[first])
            if count == 1:
                self.memcpy_async(dst + int(dst_offsets[first]), src + int(src_offsets[first]), width, stream=stream)
            elif width:
                self._memcpy_2d_async(dst + int(dst_offsets[first]), dst_pitch, src + int(src_offsets[first]),
                                      src_pitch, width, count, stream)

    def _memcpy_2d_async(self, dst: Address, dst_pitch: int, src: Address, src_pitch: int, width: int, height: int,
                         stream: Stream) -> None:
        """``height`` rows of ``width`` bytes, ``src_pitch`` apart in the source and ``dst_pitch`` in the destination
        (a platform without a strided copy queues one copy per row)."""
        for row in range(height):
            self.memcpy_async(dst + row * dst_pitch, src + row * src_pitch, width, stream=stream)

    @staticmethod
    def _copy_size(dst: Address, src: Address, nbytes: int, call: str) -> int:
        for what, address in (("destination", dst), ("source", src)):
            if not isinstance(address, (CpuAddress, DeviceAddress)):
                raise AddressDomainError(f"{call}: the {what} must be a CpuAddress or DeviceAddress, not "
                                         f"{type(address).__name__} {address!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(f"{call}: nbytes must be a non-negative int, got {nbytes!r}")
        return nbytes

    @abc.abstractmethod
    def _memcpy(self, dst: Address, src: Address, nbytes: int) -> None:
        """Copy ``nbytes`` (> 0, checked) on the legacy stream, as cudaMemcpy."""

    @abc.abstractmethod
    def _memcpy_async(self, dst: Address, src: Address, nbytes: int, stream: Stream) -> None:
        """Queue a copy of ``nbytes`` (> 0, checked) on ``stream``."""

    # -- streams and events ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(self, device: int | None = None) -> Stream:
        """A new non-blocking stream of ``device`` (default: the current one)."""

    @abc.abstractmethod
    def create_event(self, device: int | None = None, *, timing: bool = False) -> Event:
        """An event of ``device`` (default: the current one). Events only order and signal unless ``timing`` asks
        for timestamps (``elapsed_ms``): CUDA records and waits on untimed events faster."""

    def current_stream(self, device: int | None = None) -> Stream:
        """The stream the caller's device work goes to: the one set by :meth:`use_stream` in this thread, else the
        platform's notion (torch's current stream on CUDA when torch is in use, else the legacy default stream)."""
        device = self.current_device() if device is None else self.check_device(device)
        chosen = getattr(self._stream_override, "streams", {}).get(device)
        return chosen if chosen is not None else self._current_stream(device)

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        """Make ``stream`` the current stream of its device in this thread, inside the block."""
        stream = self.as_stream(stream)
        streams = self._stream_override.__dict__.setdefault("streams", {})
        previous = streams.get(stream.device)
        streams[stream.device] = stream
        try:
            yield stream
        finally:
            streams[stream.device] = previous

    @abc.abstractmethod
    def legacy_stream(self, device: int) -> Stream:
        """The device's legacy default stream: where the synchronous copy API queues its work."""

    @abc.abstractmethod
    def as_stream(self, stream: Any) -> Stream:
        """This runtime's stream for ``stream`` (one of its own; the CUDA runtime also takes torch streams)."""

    @abc.abstractmethod
    def as_event(self, event: Any) -> Event:
        """This runtime's event for ``event`` (one of its own; the CUDA runtime also takes torch events)."""

    def _current_stream(self, device: int) -> Stream:
        """The platform's current stream of ``device`` (checked): the legacy stream, unless the platform shares
        another's notion of it (torch's, on CUDA)."""
        return self.legacy_stream(device)

    # -- kernels ---------------------------------------------------------------------------------------------------
    def load_program(self, spec: ProgramSpec, device: int) -> Program:
        """The program of ``spec`` on ``device``, loaded on first use and kept for the runtime's lifetime."""
        self.check_device(device)
        with self._lock:
            key = (spec.key, device)
            if key not in self._programs:
                self._programs[key] = self._load_program(spec, device)
            return self._programs[key]

    def supports_wait_value(self, device: int) -> bool:
        """Whether :meth:`wait_value` works on ``device`` (64-bit stream memory operations)."""
        return False

    def wait_value(self, stream: Stream, address: DeviceAddress, value: int) -> None:
        """Make ``stream`` wait until the uint64 at ``address`` (device memory of the stream's device) reaches
        ``value`` (cuStreamWaitValue64, GEQ). The writer must be queued before the wait, with everything it waits for:
        the GPU does not see this dependency, so a wait queued ahead of its own writer deadlocks."""
        if not isinstance(stream, Stream):
            raise InvalidArgument(f"wait_value: {stream!r} is not a stream")
        if not isinstance(address, DeviceAddress) or address.device != stream.device:
            raise AddressDomainError(f"wait_value: {address!r} is not a DeviceAddress of device {stream.device}")
        if not address.aligned(8):
            raise InvalidArgument(f"wait_value: {address} is not 8-byte aligned")
        try:
            target = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            target = -1
        if not 0 <= target < 1 << 63:
            raise InvalidArgument(f"wait_value: value must be an integer in [0, 2**63), got {value!r}")
        value = target
        if not self.supports_wait_value(stream.device):
            raise InvalidArgument(f"{self.name} cannot make a stream wait on a memory value on device "
                                  f"{stream.device}")
        self._wait_value(stream, address, value)

    def _wait_value(self, stream: Stream, address: DeviceAddress, value: int) -> None:
        """Queue the wait (checked); a platform whose :meth:`supports_wait_value` says yes implements it."""
        raise InvalidArgument(f"{self.name}: supports_wait_value says yes, but {type(self).__name__} implements no "
                              f"_wait_value")

    def launch(self, program: Program, name: str, *, grid: int, block: int, args: Sequence[KernelArg],
               stream: Stream, shared_bytes: int = 0) -> None:
        """Queue kernel ``name`` of ``program`` on ``stream``; every pointer argument must be a DeviceAddress of the
        program's device (the launch boundary above resolved it), so no CPU address reaches a kernel.
        ``shared_bytes``: dynamic shared memory per block."""
        if name not in program.spec.names:
            raise InvalidArgument(f"program {program.spec.key} has no kernel {name!r} (it has {program.spec.names})")
        if stream.device != program.device:
            raise WrongDeviceError(f"a program of device {program.device} launched on a stream of device "
                                   f"{stream.device}")
        if grid < 1 or block < 1 or shared_bytes < 0:
            raise InvalidArgument(f"launch of {grid} blocks x {block} threads, {shared_bytes} bytes of shared memory")
        self._launch(program, name, grid, block, list(args), stream, shared_bytes)

    @abc.abstractmethod
    def _load_program(self, spec: ProgramSpec, device: int) -> Program:
        """The program of ``spec`` loaded on ``device`` (called once per spec and device)."""

    @abc.abstractmethod
    def _launch(self, program: Program, name: str, grid: int, block: int, args: list[KernelArg],
                stream: Stream, shared_bytes: int = 0) -> None:
        """Queue kernel ``name`` of ``program`` on ``stream`` (all checked), packing ``args`` the platform's way."""

    # -- host memory primitives ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _host_alloc(self, nbytes: int) -> int:
        """The CPU address of ``nbytes`` of new pinned, mapped, portable host memory."""

    @abc.abstractmethod
    def _host_free(self, address: int) -> None:
        """Free a ``_host_alloc`` range after the devices' queued work, as cudaFreeHost."""

    @abc.abstractmethod
    def _host_register(self, address: int, nbytes: int, flags: HostRegisterFlags) -> None:
        """Pin and map existing host memory."""

    @abc.abstractmethod
    def _host_unregister(self, address: int) -> None:
        """Undo ``_host_register`` of the range starting at ``address``."""

    @abc.abstractmethod
    def _host_get_device_pointer(self, address: int) -> int:
        """The current device's alias of registered or pinned host memory."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


MAX_PITCH = (1 << 31) - 1
"""The largest pitch a strided copy may have: cudaMemcpy2DAsync refuses more (``cudaDevAttrMaxPitch``, 2 GiB - 1 on
NVIDIA GPUs; HIP's is no larger). Copies farther apart than this go one by one or batched."""


def strided_groups(dst_offsets: np.ndarray, src_offsets: np.ndarray, sizes: np.ndarray,
                   dst_segments: np.ndarray | None = None, src_segments: np.ndarray | None = None) -> np.ndarray:
    """Consecutive copies that form one strided copy: rows ``(first, count, dst_pitch, src_pitch)``. A group's copies
    have one size and are evenly spaced, forwards, at least a size and at most MAX_PITCH apart, on both sides (what a
    2D copy can express); a copy that fits no group is a group of one. Vectorised (a load of 2,048 pages × 64 layer
    tensors is one pass): a group ends where the next copy does not link, or where the spacing changes after a link.
    ``*_segments`` (one id per copy) keep a group within one segment: a registration a strided copy may not leave."""
    n = sizes.size
    if n < 2:
        return np.array([[0, n, 0, 0]] if n else [], dtype=np.int64).reshape(-1, 4)
    dst_step, src_step = np.diff(dst_offsets), np.diff(src_offsets)
    links = (sizes[1:] == sizes[:-1]) & (sizes[:-1] > 0) & (dst_step >= sizes[:-1]) & (src_step >= sizes[:-1])
    links &= (dst_step <= MAX_PITCH) & (src_step <= MAX_PITCH)
    for segment in (dst_segments, src_segments):
        if segment is not None:
            links &= segment[1:] == segment[:-1]
    breaks = ~links
    breaks[1:] |= links[:-1] & ((dst_step[1:] != dst_step[:-1]) | (src_step[1:] != src_step[:-1]))
    first = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    count = np.diff(np.concatenate((first, [n])))
    at = np.minimum(first, n - 2)
    grouped = count > 1
    return np.stack([first, count, np.where(grouped, dst_step[at], 0), np.where(grouped, src_step[at], 0)],
                    axis=1).astype(np.int64)


def split_groups(groups: np.ndarray, min_rows: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the groups of at least ``min_rows`` copies (one bound for all, or one per group), to go as strided copies;
    the index of every other copy, in order, to go one by one or batched): a strided copy is one driver call, so a
    short group is cheaper as entries of a batched call."""
    count, least = groups[:, 1], np.maximum(min_rows, 2)
    strided = groups[count >= least]
    small = groups[(count < least) & (count > 0)]
    starts, counts = small[:, 0], small[:, 1]
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return strided, np.repeat(starts, counts) + within
