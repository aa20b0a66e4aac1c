"""AMD ROCm/HIP through a thin ctypes layer over ``libamdhip64``.

Why ctypes and not AMD's ``hip-python``: each hip-python release is built against one ROCm release and loads only
with it (the PyPI wheels target ROCm 6-7; Debian 12 ships ROCm 5.2), while the few dozen C functions kvtier calls have
kept their signatures since ROCm 5. ctypes loads whichever ``libamdhip64.so`` is installed (``KVTIER_HIP_LIBRARY``
names another). What did change between releases is handled here, in one place each: the ``hipMemoryType`` numbers
(ROCm 6 took CUDA's; ROCm 5 has no managed type and flags managed memory with ``isManaged``), and
``hipPointerGetAttributes`` on memory HIP does not know (``hipErrorInvalidValue``, a sticky error kvtier clears).

Every call goes through :meth:`HipLibrary.check`, which raises :class:`RuntimeCallError` with HIP's own error name.
Verified here: loading, error mapping, argument packing and attribute parsing (unit tests), and the clear "no AMD GPU"
error; not verified on AMD hardware (none is lent to this project): run ``scripts/amd_check.sh`` there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.address import Address, DeviceAddress
from kvtier.errors import InvalidArgument, RuntimeCallError, RuntimeUnavailable, WrongRuntime
from kvtier.runtime.base import (
    DeviceAttributes,
    Event,
    Graph,
    HostRegisterFlags,
    MemoryType,
    PointerAttributes,
    Runtime,
    Stream,
)
from kvtier.runtime.program import KernelArg, Program, ProgramSpec, pack_parameters

LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5")
LIBRARY_VAR = "KVTIER_HIP_LIBRARY"

# hip_runtime_api.h values, the same in ROCm 5.2 and 7.x (checked against both headers)
SUCCESS, INVALID_VALUE, NO_DEVICE, NOT_READY = 0, 1, 100, 600
ATTRIBUTES = {"can_map_host_memory": 3, "can_use_host_pointer_for_registered_mem": 4, "major": 23, "minor": 61,
              "multiprocessors": 63, "pageable_memory_access": 65, "total_memory": 84, "unified_addressing": 85,
              "stream_wait_value": 10013}
HOST_MALLOC_PORTABLE, HOST_MALLOC_MAPPED = 1, 2
STREAM_NON_BLOCKING, EVENT_DISABLE_TIMING, MEMCPY_DEFAULT, WAIT_VALUE_GTE = 1, 2, 4, 0
CAPTURE_THREAD_LOCAL = 1
# hipMemoryType: ROCm 5 counted from Host = 0; ROCm 6 took CUDA's numbers (Unregistered 0, Host 1, Device 2, ...)
MEMORY_TYPES_ROCM5 = {0: MemoryType.HOST, 1: MemoryType.DEVICE, 3: MemoryType.MANAGED}
MEMORY_TYPES_ROCM6 = {0: MemoryType.UNREGISTERED, 1: MemoryType.HOST, 2: MemoryType.DEVICE, 3: MemoryType.MANAGED,
                      11: MemoryType.MANAGED}
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")

P, INT, U, SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
PP, PI = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)


class PointerAttribute(ctypes.Structure):
    """hipPointerAttribute_t: the same 32-byte layout in ROCm 5 (memoryType) and 6+ (type)."""

    _fields_ = [("type", INT), ("device", INT), ("devicePointer", P), ("hostPointer", P), ("isManaged", INT),
                ("allocationFlags", U)]


SIGNATURES: dict[str, list[Any]] = {
    "hipGetDeviceCount": [PI], "hipGetDevice": [PI], "hipSetDevice": [INT], "hipRuntimeGetVersion": [PI],
    "hipDeviceGetAttribute": [PI, INT, INT], "hipDeviceGetName": [ctypes.c_char_p, INT, INT],
    "hipDeviceGetPCIBusId": [ctypes.c_char_p, INT, INT],
    "hipDeviceTotalMem": [ctypes.POINTER(SZ), INT],
    "hipDeviceSynchronize": [], "hipGetLastError": [],
    "hipHostMalloc": [PP, SZ, U], "hipHostFree": [P], "hipHostRegister": [P, SZ, U], "hipHostUnregister": [P],
    "hipHostGetDevicePointer": [PP, P, U], "hipPointerGetAttributes": [ctypes.POINTER(PointerAttribute), P],
    "hipMalloc": [PP, SZ], "hipFree": [P],
    "hipMemcpy": [P, P, SZ, INT], "hipMemcpyAsync": [P, P, SZ, INT, P],
    "hipMemcpy2DAsync": [P, SZ, P, SZ, SZ, SZ, INT, P],
    "hipStreamCreateWithFlags": [PP, U], "hipStreamDestroy": [P], "hipStreamSynchronize": [P],
    "hipStreamWaitEvent": [P, P, U], "hipStreamBeginCapture": [P, INT], "hipStreamEndCapture": [P, PP],
    "hipStreamIsCapturing": [P, PI], "hipStreamWaitValue64": [P, P, ctypes.c_uint64, U, ctypes.c_uint64],
    "hipGraphInstantiate": [PP, P, P, ctypes.c_char_p, SZ], "hipGraphLaunch": [P, P], "hipGraphExecDestroy": [P],
    "hipGraphDestroy": [P],
    "hipEventCreateWithFlags": [PP, U], "hipEventDestroy": [P], "hipEventRecord": [P, P], "hipEventQuery": [P],
    "hipEventSynchronize": [P], "hipEventElapsedTime": [ctypes.POINTER(ctypes.c_float), P, P],
    "hipModuleLoadData": [PP, P], "hipModuleGetFunction": [PP, P, ctypes.c_char_p],
    "hipModuleLaunchKernel": [P, U, U, U, U, U, U, U, P, PP, PP],
}


class HipLibrary:
    """``libamdhip64`` with every function kvtier calls declared, and the one error check."""

    def __init__(self, path: str | None = None) -> None:
        names = [path] if path else ([os.environ[LIBRARY_VAR]] if os.environ.get(LIBRARY_VAR) else list(LIBRARIES))
        errors = []
        for name in names:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as exc:
                errors.append(str(exc))
        else:
            raise RuntimeUnavailable(f"hip runtime unusable on this machine (no AMD GPU runtime: no HIP library; "
                                     f"{'; '.join(errors)}); install ROCm (libamdhip64) or set {LIBRARY_VAR}; the "
                                     f"emulated runtime (KVTIER_RUNTIME=emulated:split) needs no GPU")
        missing = [name for name in ("hipGetDeviceCount", "hipGetErrorName", "hipGetErrorString")
                   if getattr(self.lib, name, None) is None]
        if missing:
            raise RuntimeUnavailable(f"hip runtime unusable on this machine (no AMD GPU runtime: {self.lib._name} is "
                                     f"not a HIP runtime library, it lacks {', '.join(missing)}); set {LIBRARY_VAR} "
                                     f"to libamdhip64")
        for name, argtypes in SIGNATURES.items():
            function = getattr(self.lib, name, None)
            if function is not None:
                function.argtypes, function.restype = argtypes, ctypes.c_int
        for name in ("hipGetErrorName", "hipGetErrorString"):
            function = getattr(self.lib, name)
            function.argtypes, function.restype = [INT], ctypes.c_char_p

    def error(self, status: int, call: str) -> RuntimeCallError:
        name = self.lib.hipGetErrorName(status) or f"hipError {status}".encode()
        text = self.lib.hipGetErrorString(status) or b""
        return RuntimeCallError(call, name.decode(errors="replace"), text.decode(errors="replace"))

    def check(self, status: int, call: str) -> None:
        if status != SUCCESS:
            raise self.error(status, call)

    def call(self, name: str, *args: Any) -> None:
        """``name(*args)``, checked; out-parameters are ctypes objects the caller reads afterwards."""
        function = getattr(self.lib, name, None)
        if function is None:
            raise RuntimeCallError(name, "hipErrorNotSupported", "this HIP library does not export it")
        self.check(function(*args), name)

    def out(self, name: str, ctype: Any, *args: Any) -> Any:
        """Call ``name(&value, *args)`` and return ``value.value``."""
        value = ctype()
        self.call(name, ctypes.byref(value), *args)
        return value.value


def memory_types(version: int) -> dict[int, MemoryType]:
    """The hipMemoryType numbering of a HIP runtime version (hipRuntimeGetVersion: major * 10**7 + minor * 10**5)."""
    return MEMORY_TYPES_ROCM6 if version >= 60_000_000 else MEMORY_TYPES_ROCM5


def gfx_name(target_version: int) -> str:
    """KFD's gfx_target_version (e.g. 90010, 90402, 90500) as an LLVM target name (gfx90a, gfx942, gfx950)."""
    major, minor, stepping = target_version // 10000, target_version // 100 % 100, target_version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def kfd_targets(nodes: Path = KFD_NODES) -> dict[tuple[int, int], str]:
    """The GPUs the kernel driver lists, as {(PCI domain, location id): gfx target} (CPU nodes report target 0 and are
    skipped). How a device maps to a code-object target without reading hipDeviceProp_t, whose layout changes between
    releases."""
    targets = {}
    for node in nodes.glob("*"):
        try:
            properties = dict(line.split(None, 1) for line in (node / "properties").read_text().splitlines()
                              if " " in line)
            target = int(properties.get("gfx_target_version", "0").strip() or 0)
            where = (int(properties.get("domain", "0")), int(properties.get("location_id", "0")))
        except (OSError, ValueError):
            continue
        if target:
            targets[where] = gfx_name(target)
    return targets


def pci_location(bus_id: str) -> tuple[int, int]:
    """``0000:c1:00.0`` (hipDeviceGetPCIBusId) as KFD's (domain, location_id = bus << 8 | device << 3 | function)."""
    domain, bus, rest = bus_id.strip().split(":")
    device, function = rest.split(".")
    return int(domain, 16), int(bus, 16) << 8 | int(device, 16) << 3 | int(function, 16)


@contextlib.contextmanager
def _current_device(hip: HipLibrary, device: int) -> Iterator[None]:
    previous = int(hip.out("hipGetDevice", INT))
    if previous != device:
        hip.call("hipSetDevice", device)
    try:
        yield
    finally:
        if previous != device:
            hip.call("hipSetDevice", previous)


class HipStream(Stream):
    def __init__(self, hip: HipLibrary, device: int, handle: int, owned: bool) -> None:
        self._hip, self.device, self.handle = hip, device, int(handle)
        self._finalizer = weakref.finalize(self, hip.lib.hipStreamDestroy, P(self.handle)) if owned else None

    @property
    def native(self) -> ctypes.c_void_p:
        if self._finalizer is not None and not self._finalizer.alive:
            raise InvalidArgument("this HIP stream is closed")
        return P(self.handle)

    def on_device(self) -> contextlib.AbstractContextManager[None]:
        """Handle 0 is the null stream of whichever device is current: make this stream's device current for it."""
        return _current_device(self._hip, self.device) if self.handle == 0 else contextlib.nullcontext()

    def synchronize(self) -> None:
        with self.on_device():
            self._hip.call("hipStreamSynchronize", self.native)

    def wait(self, event: Event) -> None:
        if not isinstance(event, HipEvent):
            raise WrongRuntime(f"a HIP stream can only wait on a HIP event, not {event!r}")
        with self.on_device():
            self._hip.call("hipStreamWaitEvent", self.native, event._handle(), 0)

    @property
    def capturing(self) -> bool:
        return bool(self._hip.out("hipStreamIsCapturing", INT, self.native))

    def begin_capture(self) -> None:
        self._hip.call("hipStreamBeginCapture", self.native, CAPTURE_THREAD_LOCAL)

    def end_capture(self) -> HipGraph:
        graph = P()
        self._hip.call("hipStreamEndCapture", self.native, ctypes.byref(graph))
        return HipGraph(self._hip, graph.value or 0)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


class HipGraph(Graph):
    def __init__(self, hip: HipLibrary, graph: int) -> None:
        self._hip = hip
        executable = P()
        try:
            hip.call("hipGraphInstantiate", ctypes.byref(executable), P(graph), None, None, 0)
        except BaseException:
            hip.lib.hipGraphDestroy(P(graph))
            raise
        self._executable = executable.value or 0
        self._finalizer = weakref.finalize(self, _destroy_graph, hip, graph, self._executable)

    def launch(self, stream: Stream) -> None:
        if not isinstance(stream, HipStream):
            raise WrongRuntime(f"a HIP graph launches on a HIP stream, not {stream!r}")
        if not self._finalizer.alive:
            raise InvalidArgument("this HIP graph is closed")
        with stream.on_device():
            self._hip.call("hipGraphLaunch", P(self._executable), stream.native)

    def close(self) -> None:
        self._finalizer()


def _destroy_graph(hip: HipLibrary, graph: int, executable: int) -> None:
    hip.lib.hipGraphExecDestroy(P(executable))
    hip.lib.hipGraphDestroy(P(graph))


class HipEvent(Event):
    def __init__(self, hip: HipLibrary, device: int, timing: bool = False) -> None:
        self._hip, self.device = hip, device
        handle = P()
        hip.call("hipEventCreateWithFlags", ctypes.byref(handle), 0 if timing else EVENT_DISABLE_TIMING)
        self.native = handle.value or 0
        self._finalizer = weakref.finalize(self, hip.lib.hipEventDestroy, P(self.native))

    def _handle(self) -> ctypes.c_void_p:
        if not self._finalizer.alive:
            raise InvalidArgument("this HIP event is closed")
        return P(self.native)

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, HipStream):
            raise WrongRuntime(f"a HIP event can only be recorded on a HIP stream, not {stream!r}")
        with stream.on_device():
            self._hip.call("hipEventRecord", self._handle(), stream.native)

    def query(self) -> bool:
        status = self._hip.lib.hipEventQuery(self._handle())
        if status == NOT_READY:
            return False
        self._hip.check(status, "hipEventQuery")
        return True

    def synchronize(self) -> None:
        self._hip.call("hipEventSynchronize", self._handle())

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, HipEvent):
            raise WrongRuntime("elapsed_ms needs two HIP events")
        return float(self._hip.out("hipEventElapsedTime", ctypes.c_float, self._handle(), end._handle()))

    def _close(self) -> None:
        self._finalizer()


class HipProgram(Program):
    def __init__(self, spec: ProgramSpec, device: int, origin: str, module: int, functions: dict[str, int]) -> None:
        self.spec, self.device, self.origin, self.module, self.functions = spec, device, origin, module, functions


class HipRuntime(Runtime):
    name = "hip"
    torch_device = "cuda"  # ROCm builds of torch keep CUDA's names

    def __init__(self, library: HipLibrary | None = None) -> None:
        super().__init__()
        self._hip = hip = library or HipLibrary()
        count = ctypes.c_int(0)
        status = hip.lib.hipGetDeviceCount(ctypes.byref(count))
        if status != SUCCESS or count.value == 0:
            reason = "no AMD GPU" if status in (SUCCESS, NO_DEVICE) else str(hip.error(status, "hipGetDeviceCount"))
            raise RuntimeUnavailable(f"hip runtime unusable on this machine ({reason}); the emulated runtime "
                                     f"(KVTIER_RUNTIME=emulated:split) needs no GPU")
        self._count = count.value
        self.version = hip.out("hipRuntimeGetVersion", INT)
        self._memory_types = memory_types(self.version)
        self._targets = kfd_targets()

    def device_count(self) -> int:
        return self._count

    def current_device(self) -> int:
        return int(self._hip.out("hipGetDevice", INT))

    def set_device(self, device: int) -> None:
        self._hip.call("hipSetDevice", self.check_device(device))

    def _attribute(self, key: str, device: int) -> int:
        return int(self._hip.out("hipDeviceGetAttribute", INT, ATTRIBUTES[key], device))

    def device_attributes(self, device: int) -> DeviceAttributes:
        self.check_device(device)
        name = ctypes.create_string_buffer(256)
        self._hip.call("hipDeviceGetName", name, len(name), device)
        total = self._hip.out("hipDeviceTotalMem", SZ, device)

        def flag(key: str) -> bool:
            return bool(self._attribute(key, device))

        return DeviceAttributes(
            name=name.value.decode(errors="replace"),
            compute_capability=(self._attribute("major", device), self._attribute("minor", device)),
            total_memory=int(total), multiprocessors=self._attribute("multiprocessors", device),
            can_use_host_pointer_for_registered_mem=flag("can_use_host_pointer_for_registered_mem"),
            unified_addressing=flag("unified_addressing"), can_map_host_memory=flag("can_map_host_memory"),
            pageable_memory_access=flag("pageable_memory_access"), host_register_supported=True,
            arch=self._target(device))

    def _target(self, device: int) -> str:
        """The device's gfx target, matched to its KFD node by PCI address (HIP's device numbers follow
        HIP_VISIBLE_DEVICES and skip GPUs a container cannot open; KFD lists every GPU); empty when unknown."""
        bus = ctypes.create_string_buffer(32)
        self._hip.call("hipDeviceGetPCIBusId", bus, len(bus), device)
        return self._targets.get(pci_location(bus.value.decode()), "")

    def _synchronize(self, device: int) -> None:
        with self.using_device(device):
            self._hip.call("hipDeviceSynchronize")

    def _host_alloc(self, nbytes: int) -> int:
        pointer = P()
        self._hip.call("hipHostMalloc", ctypes.byref(pointer), nbytes, HOST_MALLOC_PORTABLE | HOST_MALLOC_MAPPED)
        return int(pointer.value or 0)

    def _host_free(self, address: int) -> None:
        self._hip.call("hipHostFree", P(address))

    def _host_register(self, address: int, nbytes: int, flags: HostRegisterFlags) -> None:
        self._hip.call("hipHostRegister", P(address), nbytes, int(flags))

    def _host_unregister(self, address: int) -> None:
        self._hip.call("hipHostUnregister", P(address))

    def _host_get_device_pointer(self, address: int) -> int:
        pointer = P()
        self._hip.call("hipHostGetDevicePointer", ctypes.byref(pointer), P(address), 0)
        return int(pointer.value or 0)

    def pointer_attributes(self, address: int) -> PointerAttributes:
        attrs = PointerAttribute()
        status = self._hip.lib.hipPointerGetAttributes(ctypes.byref(attrs), P(address))
        if status == INVALID_VALUE:  # memory HIP does not know (a sticky error in HIP: cleared here)
            self._hip.lib.hipGetLastError()
            return PointerAttributes(MemoryType.UNREGISTERED, None, None, None)
        self._hip.check(status, "hipPointerGetAttributes")
        return parse_pointer_attributes(attrs, self._memory_types)

    def device_alloc(self, nbytes: int, device: int) -> int:
        pointer = P()
        with self.using_device(device):
            self._hip.call("hipMalloc", ctypes.byref(pointer), nbytes)
        return int(pointer.value or 0)

    def device_free(self, address: int) -> None:
        self._hip.call("hipFree", P(address))

    def _memcpy(self, dst: Address, src: Address, nbytes: int) -> None:
        self._hip.call("hipMemcpy", P(dst.value), P(src.value), nbytes, MEMCPY_DEFAULT)

    def _memcpy_async(self, dst: Address, src: Address, nbytes: int, stream: Stream) -> None:
        target = self.as_stream(stream)
        with target.on_device():
            self._hip.call("hipMemcpyAsync", P(dst.value), P(src.value), nbytes, MEMCPY_DEFAULT, target.native)

    def _memcpy_runs(self, dst: Address, dst_offsets: np.ndarray, src: Address, src_offsets: np.ndarray,
                     sizes: np.ndarray, stream: Stream, batched: bool) -> None:
        """One hipMemcpy2DAsync per strided group, one hipMemcpyAsync per other copy (HIP has no batched copy that
        kvtier relies on)."""
        target = self.as_stream(stream)
        native = target.native
        groups = self.groups(dst, dst_offsets, src, src_offsets, sizes)
        first = groups[:, 0]
        with target.on_device():
            for d, s, n, count, dst_pitch, src_pitch in zip((dst.value + dst_offsets[first]).tolist(),
                                                            (src.value + src_offsets[first]).tolist(),
                                                            sizes[first].tolist(), *groups[:, 1:].T.tolist(),
                                                            strict=True):
                if count > 1:
                    self._hip.call("hipMemcpy2DAsync", P(d), dst_pitch, P(s), src_pitch, n, count, MEMCPY_DEFAULT,
                                   native)
                elif n:
                    self._hip.call("hipMemcpyAsync", P(d), P(s), n, MEMCPY_DEFAULT, native)

    def _memcpy_2d_async(self, dst: Address, dst_pitch: int, src: Address, src_pitch: int, width: int, height: int,
                         stream: Stream) -> None:
        target = self.as_stream(stream)
        with target.on_device():
            self._hip.call("hipMemcpy2DAsync", P(dst.value), dst_pitch, P(src.value), src_pitch, width, height,
                           MEMCPY_DEFAULT, target.native)

    def create_stream(self, device: int | None = None) -> HipStream:
        device = self.current_device() if device is None else device
        handle = P()
        with self.using_device(device):
            self._hip.call("hipStreamCreateWithFlags", ctypes.byref(handle), STREAM_NON_BLOCKING)
        return HipStream(self._hip, device, handle.value or 0, owned=True)

    def wrap_stream(self, handle: int, device: int) -> HipStream:
        return HipStream(self._hip, self.check_device(device), handle, owned=False)

    def as_stream(self, stream: Any) -> HipStream:
        if isinstance(stream, HipStream):
            return stream
        if hasattr(stream, "cuda_stream") and hasattr(stream, "device"):  # torch on ROCm keeps CUDA's names
            return self.wrap_stream(int(stream.cuda_stream), int(stream.device.index or 0))
        raise WrongRuntime(f"hip runtime needs a HIP or torch (ROCm) stream, got {stream!r}")

    def as_event(self, event: Any) -> HipEvent:
        if isinstance(event, HipEvent):
            return event
        raise WrongRuntime(f"hip runtime needs a HIP event, got {event!r}")

    def _current_stream(self, device: int) -> HipStream:
        """torch's current stream where torch (a ROCm build keeps the ``torch.cuda`` names) has initialised the GPU,
        else the null stream."""
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch.version, "hip", None) and torch.cuda.is_initialized():
            return self.wrap_stream(int(torch.cuda.current_stream(device).cuda_stream), device)
        return self.wrap_stream(0, device)

    def legacy_stream(self, device: int) -> HipStream:
        return self.wrap_stream(0, device)

    def create_event(self, device: int | None = None, *, timing: bool = False) -> HipEvent:
        device = self.current_device() if device is None else self.check_device(device)
        with self.using_device(device):
            return HipEvent(self._hip, device, timing=timing)

    def _load_program(self, spec: ProgramSpec, device: int) -> Program:
        arch = self.device_attributes(device).arch
        if not arch:
            raise RuntimeCallError("hipModuleLoadData", "hipErrorNoBinaryForGpu",
                                   f"cannot tell device {device}'s gfx target (no KFD topology node at its PCI "
                                   f"address under {KFD_NODES})")
        image, origin = spec.image(arch)
        module = P()
        blob = ctypes.create_string_buffer(image, len(image))
        with self.using_device(device):
            self._hip.call("hipModuleLoadData", ctypes.byref(module), blob)
        functions = {}
        for name in spec.names:
            function = P()
            self._hip.call("hipModuleGetFunction", ctypes.byref(function), module, name.encode())
            functions[name] = function.value or 0
        return HipProgram(spec, device, origin, module.value or 0, functions)

    def _launch(self, program: Program, name: str, grid: int, block: int, args: list[KernelArg],
                stream: Stream, shared_bytes: int = 0) -> None:
        if not isinstance(program, HipProgram):
            raise WrongRuntime(f"{program!r} was not loaded by the HIP runtime")
        blob, offsets = pack_parameters(args, program.device)
        packed = ctypes.create_string_buffer(blob, len(blob))
        base = ctypes.addressof(packed)
        params = (ctypes.c_void_p * len(offsets))(*[base + offset for offset in offsets])
        with self.using_device(program.device):
            self._hip.call("hipModuleLaunchKernel", P(program.functions[name]), grid, 1, 1, block, 1, 1,
                           shared_bytes, self.as_stream(stream).native, params, None)

    def supports_wait_value(self, device: int) -> bool:
        return bool(self._attribute("stream_wait_value", self.check_device(device)))

    def _wait_value(self, stream: Stream, address: DeviceAddress, value: int) -> None:
        """hipStreamWaitValue64 on hipMalloc memory: ROCm's default (GPU_STREAMOPS_CP_WAIT=0) waits with a polling
        kernel, which takes any device memory; GPU_STREAMOPS_CP_WAIT=1 wants hipMallocSignalMemory and refuses."""
        with self.using_device(stream.device):
            self._hip.call("hipStreamWaitValue64", self.as_stream(stream).native, P(address.value), value,
                           WAIT_VALUE_GTE, 0xFFFFFFFFFFFFFFFF)


def parse_pointer_attributes(attrs: PointerAttribute, types: dict[int, MemoryType]) -> PointerAttributes:
    kind = MemoryType.MANAGED if attrs.isManaged else types.get(int(attrs.type), MemoryType.UNREGISTERED)
    if kind is MemoryType.UNREGISTERED:
        return PointerAttributes(kind, None, None, None)
    return PointerAttributes(kind, int(attrs.device), int(attrs.devicePointer or 0) or None,
                             int(attrs.hostPointer or 0) or None)
