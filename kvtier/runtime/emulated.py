"""A CPU model of a GPU runtime with N devices, in ``unified`` or ``split`` alias mode.

``unified`` behaves like the H200: a registered host buffer's device alias is its CPU address. ``split`` behaves like
AMD MI355X or NVIDIA under WSL2: every device sees registered host memory at its own alias, distinct from the CPU
address and from the other devices' aliases, and a kernel that dereferences the CPU address faults. Copy APIs accept
both, as real ones do, which is why that bug stays hidden until a kernel runs.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvtier import osmem
from kvtier.address import Address, CpuAddress, DeviceAddress
from kvtier.errors import (
    IllegalAddress,
    InvalidArgument,
    RegistrationError,
    RuntimeCallError,
    WrongRuntime,
)
from kvtier.pause_points import reached
from kvtier.runtime.base import (
    MAX_PITCH,
    DeviceAttributes,
    Event,
    HostRegisterFlags,
    MemoryType,
    PointerAttributes,
    RunSet,
    Runtime,
    Stream,
)
from kvtier.runtime.emulated_device import (
    ALIAS_BASE,
    DEVICE_BASE,
    DEVICE_STRIDE,
    EMULATED_SPACE,
    GUARD_BYTES,
    AddressMap,
    Busy,
    DeviceMemory,
    EmulatedEvent,
    EmulatedStream,
    Mapping,
    MappingKind,
    Op,
    WaitValueOp,
)
from kvtier.runtime.emulated_scheduler import SCHEDULES, Scheduler
from kvtier.runtime.program import KernelArg, Program, ProgramSpec, argument_values
from kvtier.runtime.ranges import Range

MODES = ("split", "unified")
SHARED_BYTES_PER_BLOCK = 227 << 10


class EmulatedRuntime(Runtime):
    """Real host memory behind per-device address maps; Python reference kernels run through those maps.

    ``schedule`` and ``seed`` choose when queued work runs (see ``emulated_scheduler``; default eager, seed from
    ``$KVTIER_EMULATOR_SEED`` or 0). ``max_registration_bytes`` models drivers that refuse single registrations above
    a size (seen at 96–512 GiB); ``pinnable_bytes`` models the limit on pinned memory. Both make registration fail
    the way real systems do.
    """

    def __init__(self, mode: str = "split", devices: int = 2, *, schedule: str = "eager", seed: int | None = None,
                 max_registration_bytes: int | None = None, pinnable_bytes: int | None = None,
                 device_memory_bytes: int = 16 << 30) -> None:
        if mode not in MODES:
            raise InvalidArgument(f"emulated runtime mode must be one of {MODES}, got {mode!r}")
        if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= 64:
            raise InvalidArgument(f"emulated runtime needs 1..64 devices, got {devices!r}")
        if schedule not in SCHEDULES:
            raise InvalidArgument(f"emulated schedule must be one of {SCHEDULES}, got {schedule!r}")
        super().__init__()
        self.mode, self.schedule = mode, schedule
        self.name = ":".join(["emulated", mode, *([str(devices)] if devices != 2 or schedule != "eager" else []),
                              *([schedule] if schedule != "eager" else [])])
        self.max_registration_bytes, self.pinnable_bytes = max_registration_bytes, pinnable_bytes
        self.device_memory_bytes = device_memory_bytes
        self._maps = [AddressMap(d) for d in range(devices)]
        self._alias_next = [ALIAS_BASE + d * DEVICE_STRIDE for d in range(devices)]
        self._device_next = [DEVICE_BASE + d * DEVICE_STRIDE for d in range(devices)]
        self._device_used = [0] * devices
        self._device_allocs: dict[int, tuple[int, int, int]] = {}
        self._host_aliases: dict[int, dict[int, int]] = {}
        self._pinned_bytes = 0
        self._current = threading.local()
        self._handles = itertools.count(1)
        seed = int(os.environ.get("KVTIER_EMULATOR_SEED", "0")) if seed is None else seed
        self.scheduler = Scheduler(schedule, seed, self._lock)
        self._default_streams = [EmulatedStream(self.scheduler, d, 0) for d in range(devices)]
        for stream in self._default_streams:
            self.scheduler.add(stream)

    # -- devices ---------------------------------------------------------------------------------------------
    def device_count(self) -> int:
        return len(self._maps)

    def current_device(self) -> int:
        return getattr(self._current, "device", 0)

    def set_device(self, device: int) -> None:
        self._current.device = self.check_device(device)

    def device_attributes(self, device: int) -> DeviceAttributes:
        self.check_device(device)
        return DeviceAttributes(
            name=f"Emulated GPU ({self.mode} aliases)", compute_capability=(0, 0),
            total_memory=self.device_memory_bytes, multiprocessors=1,
            can_use_host_pointer_for_registered_mem=self.mode == "unified", unified_addressing=True,
            can_map_host_memory=True, pageable_memory_access=False, host_register_supported=True)

    def _synchronize(self, device: int) -> None:
        with self._lock:
            self.scheduler.check_not_capturing(device, "cudaDeviceSynchronize")
            self.scheduler.drain(device, "cudaDeviceSynchronize")

    def _drain_before_free(self, devices: Iterable[int], call: str) -> None:
        """cudaFree and cudaFreeHost wait for the device first; on a faulted device there is nothing left to run, and
        releasing still works here so that cleanup after a fault does not leak (CUDA returns the sticky error)."""
        for device in devices:
            if not self.scheduler.faulted(device):
                self.scheduler.drain(device, call)

    # -- host memory -----------------------------------------------------------------------------------------
    def _host_alloc(self, nbytes: int) -> int:
        address = osmem.map_memory(nbytes)
        try:
            self._map_host(address, nbytes, "cudaHostAlloc", range(self.device_count()))
        except BaseException:
            osmem.unmap_memory(address, nbytes)
            raise
        return address

    def after_device_work(self, release: Callable[[], None]) -> None:
        """Inside a running operation (a finalizer the collector ran there), after it ends (see
        :meth:`Scheduler.after_running`); then as on any runtime."""
        self.scheduler.after_running(lambda: Runtime.after_device_work(self, release))

    def _host_free(self, address: int) -> None:
        entry = self._mapped_host(address)

        def release() -> None:
            self._drain_before_free(range(self.device_count()), "cudaFreeHost")
            self._unmap_host(entry)
            osmem.unmap_memory(address, entry.nbytes)
        self.scheduler.after_running(release)

    def _host_register(self, address: int, nbytes: int, flags: HostRegisterFlags) -> None:
        """Unified addressing implies MAPPED; without PORTABLE only the current device gets an alias."""
        portable = HostRegisterFlags.PORTABLE in flags
        devices = range(self.device_count()) if portable else [self.current_device()]
        self._map_host(address, nbytes, "cudaHostRegister", devices)

    def _host_unregister(self, address: int) -> None:
        self._unmap_host(self._mapped_host(address))

    def _map_host(self, address: int, nbytes: int, call: str, devices: Iterable[int]) -> None:
        if self.max_registration_bytes is not None and nbytes > self.max_registration_bytes:
            raise RuntimeCallError(call, "cudaErrorMemoryAllocation",
                                   f"{nbytes} bytes exceed the emulated driver's per-registration limit of "
                                   f"{self.max_registration_bytes}")
        if self.pinnable_bytes is not None and self._pinned_bytes + nbytes > self.pinnable_bytes:
            raise RuntimeCallError(call, "cudaErrorMemoryAllocation",
                                   f"pinning {nbytes} more bytes exceeds the emulated limit of {self.pinnable_bytes}")
        aliases = {}
        for device in devices:
            alias = address if self.mode == "unified" else self._alias_next[device]
            self._maps[device].add(alias, nbytes, address, MappingKind.HOST_ALIAS)
            if self.mode == "split":
                self._alias_next[device] += osmem.round_up(nbytes, osmem.PAGE_SIZE) + GUARD_BYTES
            aliases[device] = alias
        self._host_aliases[address] = aliases
        self._pinned_bytes += nbytes

    def _mapped_host(self, address: int) -> Range:
        entry = self.host_range(address)
        if entry is None or entry.start not in self._host_aliases:
            raise RegistrationError(f"emulated: 0x{address:x} is not registered host memory")
        return entry

    def _unmap_host(self, entry: Range) -> None:
        for device, alias in self._host_aliases.pop(entry.start).items():
            self._maps[device].ranges.pop(alias)
        self._pinned_bytes -= entry.nbytes

    def _host_get_device_pointer(self, address: int) -> int:
        entry = self.host_range(address)
        if entry is None:
            raise RuntimeCallError("cudaHostGetDevicePointer", "cudaErrorInvalidValue",
                                   f"0x{address:x} is not registered or pinned host memory")
        aliases = self._host_aliases[entry.start]
        if self.current_device() not in aliases:
            raise RuntimeCallError("cudaHostGetDevicePointer", "cudaErrorInvalidValue",
                                   f"0x{address:x} was registered without PORTABLE on device(s) {sorted(aliases)}, "
                                   f"not on device {self.current_device()}")
        return aliases[self.current_device()] + (address - entry.start)

    # -- device memory and pointers ------------------------------------------------------------------------------
    def device_alloc(self, nbytes: int, device: int) -> int:
        self.check_device(device)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"device_alloc: size must be a positive int, got {nbytes!r}")
        with self._lock:
            self.scheduler.check_alive(device)
            if self._device_used[device] + nbytes > self.device_memory_bytes:
                raise RuntimeCallError("cudaMalloc", "cudaErrorMemoryAllocation",
                                       f"emulated device {device} has {self.device_memory_bytes} bytes")
            backing = osmem.map_memory(nbytes)
            address = self._device_next[device]
            self._maps[device].add(address, nbytes, backing, MappingKind.DEVICE_MEMORY)
            self._device_next[device] += osmem.round_up(nbytes, osmem.PAGE_SIZE) + GUARD_BYTES
            self._device_used[device] += nbytes
            self._device_allocs[address] = (device, backing, nbytes)
        return address

    def device_free(self, address: int) -> None:
        with self._lock:
            if address not in self._device_allocs:
                raise RuntimeCallError("cudaFree", "cudaErrorInvalidValue", f"0x{address:x} is not a device allocation")
            device, backing, nbytes = self._device_allocs[address]

            def release() -> None:
                self._drain_before_free([device], "cudaFree")
                del self._device_allocs[address]
                self._maps[device].ranges.pop(address)
                self._device_used[device] -= nbytes
                osmem.unmap_memory(backing, nbytes)
            self.scheduler.after_running(release)

    def _find_mapped(self, address: int, nbytes: int = 1) -> tuple[int, int, Mapping] | None:
        for device, address_map in enumerate(self._maps):
            found = address_map.lookup(address, nbytes)
            if found is not None and not (self.mode == "unified" and found[1].kind is MappingKind.HOST_ALIAS):
                return device, found[0], found[1]
        return None

    def allocation_end(self, address: int) -> int | None:
        end = super().allocation_end(address)
        if end is not None:
            return end
        for address_map in self._maps:
            entry = address_map.ranges.find(address, 1)
            if entry is not None:
                return entry.end
        return None

    def pointer_attributes(self, address: int) -> PointerAttributes:
        mapped = self._find_mapped(address)
        reached("emulated.pointer_attributes_mapped")
        if mapped is not None and mapped[2].kind is MappingKind.DEVICE_MEMORY:
            return PointerAttributes(MemoryType.DEVICE, mapped[0], address, None)
        host = mapped[1] if mapped is not None else address
        if self.host_range(host) is None:
            return PointerAttributes(MemoryType.UNREGISTERED, None, None, None)
        alias = self.host_get_device_pointer(host, self.current_device())
        return PointerAttributes(MemoryType.HOST, self.current_device(), alias, host)

    # -- copies ------------------------------------------------------------------------------------------------------
    def _locate(self, address: Address, nbytes: int, call: str) -> Callable[[], int]:
        """Check a copy operand now, as the real API does, and return what finds its bytes when the copy runs:
        memory freed or unregistered in between faults then instead of being touched."""
        if isinstance(address, DeviceAddress):
            self.check_device(address.device)
            address_map, value = self._maps[address.device], address.value
            if address_map.lookup(value, nbytes) is None:
                raise RuntimeCallError(call, "cudaErrorInvalidValue", f"{address} +{nbytes} is not mapped memory of "
                                                                      f"device {address.device} (or spans two "
                                                                      f"allocations or registrations)")
            return lambda: address_map.translate(value, nbytes)
        value = address.value
        if value >= EMULATED_SPACE:
            raise RuntimeCallError(call, "cudaErrorInvalidValue", f"{address} is a device address, not a CPU one")
        entry = self.host_overlap(value, nbytes)
        if entry is None:
            return lambda: value
        if not entry.holds(value, nbytes):
            raise RuntimeCallError(call, "cudaErrorInvalidValue",
                                   f"{address} +{nbytes} runs past its registered range [0x{entry.start:x}, "
                                   f"+{entry.nbytes}): a copy may not span two registrations or leave one")

        def registered() -> int:
            if self.host_range(entry.start) is not entry:
                raise IllegalAddress(f"{address} +{nbytes}: its host memory was unregistered before the copy ran")
            return value

        return registered

    def _memcpy_run_sets(self, sets: list[RunSet], stream: Stream, batched: bool) -> None:
        """Every copy of the call is checked (as each copy call checks its operands) before any is queued, under the
        lock, so a refused call queues nothing and nothing is freed between the check and the queuing."""
        with self._lock:
            for dst, dst_offsets, src, src_offsets, sizes in sets:
                for at_dst, at_src, nbytes in zip(dst_offsets.tolist(), src_offsets.tolist(), sizes.tolist(),
                                                  strict=True):
                    if nbytes:
                        self._locate(dst + at_dst, nbytes, "memcpy_runs_async")
                        self._locate(src + at_src, nbytes, "memcpy_runs_async")
            super()._memcpy_run_sets(sets, stream, batched)

    def _pageable(self, address: Address) -> bool:
        return isinstance(address, CpuAddress) and self.host_range(address.value) is None

    def _copy_op(self, dst: Address, src: Address, nbytes: int, call: str) -> Op:
        """The copy as a queued operation. A pageable source is read now, as the driver stages it at the call."""
        find_dst, find_src = self._locate(dst, nbytes, call), self._locate(src, nbytes, call)
        if self._pageable(src):
            staged = np.ctypeslib.as_array(osmem.byte_array(find_src(), nbytes)).copy()
            return lambda: osmem.copy(find_dst(), staged.ctypes.data, nbytes)
        return lambda: osmem.copy(find_dst(), find_src(), nbytes)

    def _copy_device(self, dst: Address, src: Address) -> int:
        side = dst if isinstance(dst, DeviceAddress) else src
        return side.device if isinstance(side, DeviceAddress) else self.current_device()

    def _memcpy(self, dst: Address, src: Address, nbytes: int) -> None:
        """On the legacy stream. Pageable host → device returns once the source is staged, before the bytes land
        (cudaMemcpy does the same); every other direction returns when the copy is done."""
        stream = self._default_streams[self._copy_device(dst, src)]
        with self._lock:
            self.scheduler.check_not_capturing(stream.device, "cudaMemcpy")
            op = self._copy_op(dst, src, nbytes, "cudaMemcpy")
            stream.enqueue(op)
            if not (self._pageable(src) and isinstance(dst, DeviceAddress)):
                stream.synchronize()

    def _memcpy_async(self, dst: Address, src: Address, nbytes: int, stream: Stream) -> None:
        """A pageable destination makes the call synchronous, as on CUDA."""
        queue = self._stream(stream)
        with self._lock:
            queue.enqueue(self._copy_op(dst, src, nbytes, "cudaMemcpyAsync"))
            if self._pageable(dst):
                queue.synchronize()

    def _memcpy_2d_async(self, dst: Address, dst_pitch: int, src: Address, src_pitch: int, width: int, height: int,
                         stream: Stream) -> None:
        """As cudaMemcpy2DAsync: the whole extent of each side (first row to the end of the last) must lie in one
        registration, not only each row (the H200 refused a 2D copy across two with cudaErrorInvalidValue), and no
        pitch may exceed the device's maximum (cudaErrorInvalidPitchValue)."""
        if max(dst_pitch, src_pitch) > MAX_PITCH:
            raise RuntimeCallError("cudaMemcpy2DAsync", "cudaErrorInvalidPitchValue",
                                   f"pitch {max(dst_pitch, src_pitch)} is above the maximum {MAX_PITCH}")
        for address, pitch in ((dst, dst_pitch), (src, src_pitch)):
            self._locate(address, (height - 1) * pitch + width, "cudaMemcpy2DAsync")
        super()._memcpy_2d_async(dst, dst_pitch, src, src_pitch, width, height, stream)

    # -- streams and events ----------------------------------------------------------------------------------------
    def create_stream(self, device: int | None = None) -> EmulatedStream:
        device = self.current_device() if device is None else self.check_device(device)
        with self._lock:
            self.scheduler.check_alive(device)
            stream = EmulatedStream(self.scheduler, device, next(self._handles))
            self.scheduler.add(stream)
        return stream

    def busy(self, stream: Stream, steps: int) -> None:
        """Queue a long kernel: ``stream`` stays busy for ``steps`` scheduler steps while other streams run (what
        ``torch.cuda._sleep`` is on a GPU); code that forgets to wait for it races it here too."""
        self._stream(stream).enqueue(Busy(steps))

    def supports_wait_value(self, device: int) -> bool:
        self.check_device(device)
        return True

    def _wait_value(self, stream: Stream, address: DeviceAddress, value: int) -> None:
        """The counter is read through the device's map when the scheduler considers the wait, so an address the
        device cannot see faults then, as a GPU's would."""
        memory = DeviceMemory(self._maps[stream.device])
        self._stream(stream).enqueue(WaitValueOp(
            lambda: int(memory.view(address.value, 8, align=8).view(np.uint64)[0]), value))

    def create_event(self, device: int | None = None, *, timing: bool = False) -> EmulatedEvent:
        return EmulatedEvent(self.scheduler, self.current_device() if device is None else self.check_device(device),
                             timing=timing)

    def default_stream(self, device: int | None = None) -> EmulatedStream:
        return self._default_streams[self.current_device() if device is None else self.check_device(device)]

    def legacy_stream(self, device: int) -> EmulatedStream:
        return self._default_streams[self.check_device(device)]

    def as_stream(self, stream: Any) -> EmulatedStream:
        return self._stream(stream)

    def as_event(self, event: Any) -> Event:
        if not isinstance(event, EmulatedEvent) or event.scheduler is not self.scheduler:
            raise WrongRuntime(f"{self.name} needs one of its own events, got {event!r}")
        return event

    def _stream(self, stream: Any) -> EmulatedStream:
        if not isinstance(stream, EmulatedStream) or stream.scheduler is not self.scheduler:
            raise WrongRuntime(f"{self.name} needs one of its own streams, got {stream!r}")
        return stream

    # -- kernels -----------------------------------------------------------------------------------------------------
    def _load_program(self, spec: ProgramSpec, device: int) -> Program:
        missing = [name for name in spec.names if name not in spec.reference]
        if missing:
            raise InvalidArgument(f"program {spec.key} has no Python reference for {missing}: the emulated runtime "
                                  f"runs references")
        return EmulatedProgram(spec, device)

    def _launch(self, program: Program, name: str, grid: int, block: int, args: list[KernelArg],
                stream: Stream, shared_bytes: int = 0) -> None:
        """Queue the kernel's Python reference; ``memory`` translates addresses as the program's device sees them.
        Dynamic shared memory is held to an H200's 227 KiB per block."""
        if shared_bytes > SHARED_BYTES_PER_BLOCK:
            raise RuntimeCallError("cuLaunchKernel", "CUDA_ERROR_INVALID_VALUE",
                                   f"{shared_bytes} bytes of shared memory per block; the emulated device has "
                                   f"{SHARED_BYTES_PER_BLOCK}")
        queue = self._stream(stream)
        values = [argument_values(arg, program.device) for arg in args]
        memory, kernel = DeviceMemory(self._maps[program.device]), program.spec.reference[name]
        queue.enqueue(lambda: kernel(memory, *values))  # a generator kernel runs in phases (``Running``)


class EmulatedProgram(Program):
    def __init__(self, spec: ProgramSpec, device: int) -> None:
        self.spec, self.device, self.origin = spec, device, "reference"
