"""A CPU model of a GPU runtime with N devices, in ``unified`` or ``split`` alias mode.

``unified`` behaves like the H200: a registered host buffer's device alias is its CPU address. ``split`` behaves like
AMD MI355X or NVIDIA under WSL2: every device sees registered host memory at its own alias, distinct from the CPU
address and from the other devices' aliases, and a kernel that dereferences the CPU address faults. Copy APIs accept
both, as real ones do, which is why that bug stays hidden until a kernel runs.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Iterable

from kvtier import osmem
from kvtier.errors import IllegalAddress, RegistrationError, RuntimeCallError
from kvtier.runtime.base import DeviceAttributes, HostRegisterFlags, MemoryType, PointerAttributes, Runtime, Stream
from kvtier.runtime.emulated_device import AddressMap, DeviceMemory, EmulatedEvent, EmulatedStream, Mapping, MappingKind

MODES = ("split", "unified")
EMULATED_SPACE = 0x1000_0000_0000_0000
ALIAS_BASE = 0x3000_0000_0000_0000
DEVICE_BASE = 0x5000_0000_0000_0000
DEVICE_STRIDE = 1 << 44
GUARD_BYTES = 1 << 20


class EmulatedRuntime(Runtime):
    """Real host memory behind per-device address maps; Python reference kernels run through those maps.

    ``max_registration_bytes`` models drivers that refuse single registrations above a size (seen at 96–512 GiB);
    ``pinnable_bytes`` models the limit on pinned memory. Both make registration fail the way real systems do.
    """

    runs_python_kernels = True

    def __init__(self, mode: str = "split", devices: int = 2, *, max_registration_bytes: int | None = None,
                 pinnable_bytes: int | None = None, device_memory_bytes: int = 16 << 30) -> None:
        if mode not in MODES:
            raise ValueError(f"emulated runtime mode must be one of {MODES}, got {mode!r}")
        if not 1 <= devices <= 64:
            raise ValueError(f"emulated runtime needs 1..64 devices, got {devices}")
        super().__init__()
        self.mode, self.name = mode, f"emulated:{mode}"
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
        self._default_streams = [EmulatedStream(d, 0) for d in range(devices)]
        self._streams: list[weakref.WeakSet[EmulatedStream]] = [weakref.WeakSet() for _ in range(devices)]

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

    def synchronize(self, device: int | None = None) -> None:
        device = self.current_device() if device is None else self.check_device(device)
        self._default_streams[device].synchronize()
        for stream in list(self._streams[device]):
            stream.synchronize()

    # -- host memory -----------------------------------------------------------------------------------------
    def _host_alloc(self, nbytes: int) -> int:
        address = osmem.map_memory(nbytes)
        try:
            self._map_host(address, nbytes, "cudaHostAlloc", range(self.device_count()))
        except BaseException:
            osmem.unmap_memory(address, nbytes)
            raise
        return address

    def _host_free(self, address: int) -> None:
        nbytes = self._unmap_host(address)
        osmem.unmap_memory(address, nbytes)

    def _host_register(self, address: int, nbytes: int, flags: HostRegisterFlags) -> None:
        """Unified addressing implies MAPPED; without PORTABLE only the current device gets an alias."""
        portable = HostRegisterFlags.PORTABLE in flags
        devices = range(self.device_count()) if portable else [self.current_device()]
        self._map_host(address, nbytes, "cudaHostRegister", devices)

    def _host_unregister(self, address: int) -> None:
        self._unmap_host(address)

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

    def _unmap_host(self, address: int) -> int:
        entry = self.host_range(address)
        if entry is None or entry.start not in self._host_aliases:
            raise RegistrationError(f"emulated: 0x{address:x} is not registered host memory")
        for device, alias in self._host_aliases.pop(entry.start).items():
            self._maps[device].ranges.pop(alias)
        self._pinned_bytes -= entry.nbytes
        return entry.nbytes

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
        if nbytes <= 0:
            raise ValueError(f"device_alloc: size must be positive, got {nbytes}")
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
        if address not in self._device_allocs:
            raise RuntimeCallError("cudaFree", "cudaErrorInvalidValue", f"0x{address:x} is not a device allocation")
        device, backing, nbytes = self._device_allocs.pop(address)
        self._maps[device].ranges.pop(address)
        self._device_used[device] -= nbytes
        osmem.unmap_memory(backing, nbytes)

    def _find_mapped(self, address: int, nbytes: int = 1) -> tuple[int, int, Mapping] | None:
        for device, address_map in enumerate(self._maps):
            found = address_map.lookup(address, nbytes)
            if found is not None and not (self.mode == "unified" and found[1].kind is MappingKind.HOST_ALIAS):
                return device, found[0], found[1]
        return None

    def pointer_attributes(self, address: int) -> PointerAttributes:
        mapped = self._find_mapped(address)
        if mapped is not None and mapped[2].kind is MappingKind.DEVICE_MEMORY:
            return PointerAttributes(MemoryType.DEVICE, mapped[0], address, None)
        host = mapped[1] if mapped is not None else address
        if self.host_range(host) is None:
            return PointerAttributes(MemoryType.UNREGISTERED, None, None, None)
        alias = self.host_get_device_pointer(host, self.current_device())
        return PointerAttributes(MemoryType.HOST, self.current_device(), alias, host)

    # -- copies, streams, kernels --------------------------------------------------------------------------------
    def _to_host(self, address: int, nbytes: int, call: str) -> int:
        """Copy APIs accept CPU addresses, aliases of any device and device memory alike."""
        if address < EMULATED_SPACE:
            entry = self.host_range(address)
            if entry is not None and not entry.holds(address, nbytes):
                raise RuntimeCallError(call, "cudaErrorInvalidValue", f"0x{address:x} +{nbytes} runs past its buffer")
            return address
        mapped = self._find_mapped(address, nbytes)
        if mapped is None:
            raise RuntimeCallError(call, "cudaErrorInvalidValue", f"0x{address:x} +{nbytes} is not mapped memory")
        return mapped[1]

    def _copy_op(self, dst: int, src: int, nbytes: int, call: str) -> Callable[[], None]:
        real_dst, real_src = self._to_host(dst, nbytes, call), self._to_host(src, nbytes, call)
        return lambda: osmem.copy(real_dst, real_src, nbytes)

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        if nbytes:
            op = self._copy_op(dst, src, nbytes, "cudaMemcpy")
            self.synchronize()
            op()

    def memcpy_async(self, dst: int, src: int, nbytes: int, *, stream: Stream) -> None:
        if nbytes:
            self._stream(stream).enqueue(self._copy_op(dst, src, nbytes, "cudaMemcpyAsync"))

    def create_stream(self, device: int | None = None) -> EmulatedStream:
        device = self.current_device() if device is None else self.check_device(device)
        stream = EmulatedStream(device, next(self._handles))
        self._streams[device].add(stream)
        return stream

    def create_event(self, device: int | None = None) -> EmulatedEvent:
        return EmulatedEvent(self.current_device() if device is None else self.check_device(device))

    def default_stream(self, device: int | None = None) -> EmulatedStream:
        return self._default_streams[self.current_device() if device is None else self.check_device(device)]

    def _stream(self, stream: Stream) -> EmulatedStream:
        if not isinstance(stream, EmulatedStream):
            raise TypeError(f"{self.name} needs one of its own streams, got {stream!r}")
        return stream

    def launch_python(self, kernel: Callable[..., Any], *args: Any, device: int | None = None,
                      stream: Stream | None = None) -> None:
        """Queue ``kernel(memory, *args)`` on a device; ``memory`` translates addresses as that device sees them."""
        device = self.current_device() if device is None else self.check_device(device)
        queue = self._default_streams[device] if stream is None else self._stream(stream)
        if queue.device != device:
            raise IllegalAddress(f"stream of device {queue.device} used to launch on device {device}")
        memory = DeviceMemory(self._maps[device])
        queue.enqueue(lambda: kernel(memory, *args))

    def run_python(self, kernel: Callable[..., Any], *args: Any, device: int | None = None) -> None:
        """Launch on the default stream and wait: the synchronous form tests and tools use."""
        device = self.current_device() if device is None else self.check_device(device)
        self.launch_python(kernel, *args, device=device)
        self._default_streams[device].synchronize()
