"""NVIDIA CUDA through NVIDIA's ``cuda-bindings`` runtime API.

Every call goes through :func:`check`, which turns a non-success status into a :class:`RuntimeCallError` naming the
call and the error, so no raw status code leaves this module. The runtime shares the driver's per-thread current
context with PyTorch, so ``set_device`` here and ``torch.cuda.set_device`` see the same device, and torch streams can
be wrapped with :meth:`CudaRuntime.wrap_stream`.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier.address import Address, CpuAddress, DeviceAddress
from kvtier.errors import InvalidArgument, KernelBuildError, RuntimeCallError, RuntimeUnavailable, WrongRuntime
from kvtier.locks import named_lock
from kvtier.runtime.base import (
    DeviceAttributes,
    Event,
    Graph,
    HostRegisterFlags,
    MemoryType,
    PointerAttributes,
    RunSet,
    Runtime,
    Stream,
    split_groups,
)
from kvtier.runtime.program import KernelArg, Program, ProgramSpec, pack_parameters


@functools.cache
def _bindings() -> Any:
    """cuda-bindings' runtime module, imported once (``check`` runs once per driver call: ~2 µs of import machinery
    each time otherwise)."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise RuntimeUnavailable(f"cuda runtime needs NVIDIA's cuda-bindings package ({exc})") from exc
    return runtime


BATCH_LIMIT = 8192
STRIDED_MIN_ROWS_BATCHED = 8  # a 2D copy costs a driver call (~5 µs of host time); a batch entry ~1-1.5 µs
BATCH_H2D_MIN_BYTES = 32 << 10  # smaller H2D copies cost 4-6 µs each in a batch, 2-3.5 µs one call each (H200)
LEGACY_STREAMS = (0, 1)  # the NULL stream and cudaStreamLegacy
DETOUR_MIN_COPIES = 16


@functools.cache
def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def check_driver(result: Any, call: str) -> Any:
    """The driver-API twin of :func:`check`."""
    driver = _driver()
    status, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        _, text = driver.cuGetErrorString(status)
        raise RuntimeCallError(call, name.decode() if name else str(status), text.decode() if text else "")
    return values[0] if len(values) == 1 else values


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-bindings ``(status, *values)`` tuple, raising on failure; returns the value(s)."""
    cudart = _bindings()
    status, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if status != cudart.cudaError_t.cudaSuccess:
        _, name = cudart.cudaGetErrorName(status)
        _, text = cudart.cudaGetErrorString(status)
        raise RuntimeCallError(call, name.decode(), text.decode())
    return values[0] if len(values) == 1 else values


class CudaStream(Stream):
    def __init__(self, cudart: Any, device: int, handle: Any, owned: bool) -> None:
        self._cudart, self.device, self._handle, self._owned = cudart, device, handle, owned
        self.handle = int(handle)
        self._finalizer = weakref.finalize(self, _destroy, cudart.cudaStreamDestroy, handle) if owned else None

    @property
    def native(self) -> Any:
        if self._finalizer is not None and not self._finalizer.alive:
            raise InvalidArgument("this CUDA stream is closed")
        return self._handle

    def synchronize(self) -> None:
        check(self._cudart.cudaStreamSynchronize(self.native), "cudaStreamSynchronize")

    def wait(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise WrongRuntime(f"a CUDA stream can only wait on a CUDA event, not {event!r}")
        check(self._cudart.cudaStreamWaitEvent(self.native, event._handle(), 0), "cudaStreamWaitEvent")

    @property
    def capturing(self) -> bool:
        status = check(self._cudart.cudaStreamIsCapturing(self.native), "cudaStreamIsCapturing")
        return status != self._cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone

    def begin_capture(self) -> None:
        mode = self._cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(self._cudart.cudaStreamBeginCapture(self.native, mode), "cudaStreamBeginCapture")

    def end_capture(self) -> "CudaGraph":
        graph = check(self._cudart.cudaStreamEndCapture(self.native), "cudaStreamEndCapture")
        return CudaGraph(self._cudart, graph)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


class CudaGraph(Graph):
    def __init__(self, cudart: Any, graph: Any) -> None:
        self._cudart = cudart
        try:
            executable = check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        except BaseException:
            cudart.cudaGraphDestroy(graph)
            raise
        self._finalizer = weakref.finalize(self, _destroy_graph, cudart, graph, executable)
        self._executable = executable

    def launch(self, stream: Stream) -> None:
        if not isinstance(stream, CudaStream):
            raise WrongRuntime(f"a CUDA graph launches on a CUDA stream, not {stream!r}")
        if not self._finalizer.alive:
            raise InvalidArgument("this CUDA graph is closed")
        check(self._cudart.cudaGraphLaunch(self._executable, stream.native), "cudaGraphLaunch")

    def close(self) -> None:
        self._finalizer()


def _destroy_graph(cudart: Any, graph: Any, executable: Any) -> None:
    cudart.cudaGraphExecDestroy(executable)
    cudart.cudaGraphDestroy(graph)


class CudaEvent(Event):
    def __init__(self, cudart: Any, device: int, borrowed: Any = None, timing: bool = False,
                 spare: list[Any] | None = None, handle: Any = None) -> None:
        """A new event (untimed unless ``timing``), or (``borrowed``) a handle someone else owns, such as a torch
        event's. With ``spare`` (the runtime's free list for this device and kind), the handle goes back there
        when the event is closed or dropped instead of being destroyed; ``handle`` is one taken from that list."""
        self._cudart, self.device = cudart, device
        self._finalizer: Any
        if borrowed is not None:
            self.native = borrowed
            self._finalizer = weakref.finalize(self, lambda: None)
            return
        if handle is not None:
            self.native = handle
        elif timing:
            self.native = check(cudart.cudaEventCreate(), "cudaEventCreate")
        else:
            self.native = check(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming),
                                "cudaEventCreateWithFlags")
        self._finalizer = weakref.finalize(self, _retire_event, cudart.cudaEventDestroy, self.native, spare)

    def _handle(self) -> Any:
        if not self._finalizer.alive:
            raise InvalidArgument("this CUDA event is closed")
        return self.native

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, CudaStream):
            raise WrongRuntime(f"a CUDA event can only be recorded on a CUDA stream, not {stream!r}")
        check(self._cudart.cudaEventRecord(self._handle(), stream.native), "cudaEventRecord")

    def query(self) -> bool:
        status = self._cudart.cudaEventQuery(self._handle())[0]
        if status == self._cudart.cudaError_t.cudaErrorNotReady:
            return False
        check((status,), "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        check(self._cudart.cudaEventSynchronize(self._handle()), "cudaEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, CudaEvent):
            raise WrongRuntime("elapsed_ms needs two CUDA events")
        return float(check(self._cudart.cudaEventElapsedTime(self._handle(), end._handle()), "cudaEventElapsedTime"))

    def _close(self) -> None:
        self._finalizer()


SPARE_EVENTS = 1024  # handles kept per device and kind; beyond that a dropped event is destroyed


def _destroy(destroy: Any, handle: Any) -> None:
    destroy(handle)


def _retire_event(destroy: Any, handle: Any, spare: list[Any] | None) -> None:
    if spare is not None and len(spare) < SPARE_EVENTS:
        spare.append(handle)
    else:
        destroy(handle)


def _version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def unusable_reason(cudart: Any, status: Any) -> str:
    """Why ``cudaGetDeviceCount`` found no device, in words: the runtime reports a missing driver and an old one
    alike as "driver version is insufficient", but ``cudaDriverGetVersion`` gives 0 only when no driver (libcuda)
    could be loaded."""
    if status == cudart.cudaError_t.cudaSuccess:
        return "no CUDA device"
    name = cudart.cudaGetErrorName(status)[1].decode()
    if name == "cudaErrorInsufficientDriver":
        driver, runtime = cudart.cudaDriverGetVersion()[1], cudart.cudaRuntimeGetVersion()[1]
        if not driver:
            return "no NVIDIA driver found: libcuda.so.1 could not be loaded"
        return (f"the NVIDIA driver supports CUDA {_version(driver)}, older than the CUDA {_version(runtime)} "
                f"runtime of cuda-bindings: update the driver, or install cuda-bindings {driver // 1000}.x")
    if name == "cudaErrorNoDevice":
        return "the NVIDIA driver found no GPU"
    return f"{name}: {cudart.cudaGetErrorString(status)[1].decode()}"


class CudaRuntime(Runtime):
    name = "cuda"
    torch_device = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self._cudart = cudart = _bindings()
        status, count = cudart.cudaGetDeviceCount()
        if status != cudart.cudaError_t.cudaSuccess or count == 0:
            raise RuntimeUnavailable(f"cuda runtime unusable on this machine ({unusable_reason(cudart, status)}); "
                                     f"the emulated runtime (KVTIER_RUNTIME=emulated:split) needs no GPU")
        self._count = count
        self._memcpy_default = cudart.cudaMemcpyKind.cudaMemcpyDefault
        self._batch_supported = hasattr(cudart, "cudaMemcpyBatchAsync")
        self._wait_value_support: dict[int, bool] = {}
        self._spare_events: dict[tuple[int, bool], list[Any]] = {}
        self._detours: dict[int, tuple[CudaStream, Any, Any]] = {}
        self._detour_lock = named_lock("cuda.detour")
        self._wait_geq = int(_driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

    def device_count(self) -> int:
        return self._count

    def current_device(self) -> int:
        return int(check(self._cudart.cudaGetDevice(), "cudaGetDevice"))

    def set_device(self, device: int) -> None:
        check(self._cudart.cudaSetDevice(self.check_device(device)), "cudaSetDevice")

    def device_attributes(self, device: int) -> DeviceAttributes:
        cudart = self._cudart
        attr = cudart.cudaDeviceAttr
        prop = check(cudart.cudaGetDeviceProperties(self.check_device(device)), "cudaGetDeviceProperties")

        def flag(name: str) -> bool:
            return bool(check(cudart.cudaDeviceGetAttribute(getattr(attr, name), device), "cudaDeviceGetAttribute"))

        return DeviceAttributes(
            name=prop.name.decode(errors="replace").rstrip("\0"), compute_capability=(prop.major, prop.minor),
            total_memory=int(prop.totalGlobalMem), multiprocessors=int(prop.multiProcessorCount),
            can_use_host_pointer_for_registered_mem=flag("cudaDevAttrCanUseHostPointerForRegisteredMem"),
            unified_addressing=flag("cudaDevAttrUnifiedAddressing"),
            can_map_host_memory=flag("cudaDevAttrCanMapHostMemory"),
            pageable_memory_access=flag("cudaDevAttrPageableMemoryAccess"),
            host_register_supported=flag("cudaDevAttrHostRegisterSupported"), arch=f"sm_{prop.major}{prop.minor}")

    def _synchronize(self, device: int) -> None:
        with self.using_device(device):
            check(self._cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def _host_alloc(self, nbytes: int) -> int:
        flags = self._cudart.cudaHostAllocPortable | self._cudart.cudaHostAllocMapped
        return int(check(self._cudart.cudaHostAlloc(nbytes, flags), "cudaHostAlloc"))

    def _host_free(self, address: int) -> None:
        check(self._cudart.cudaFreeHost(address), "cudaFreeHost")

    def _host_register(self, address: int, nbytes: int, flags: HostRegisterFlags) -> None:
        check(self._cudart.cudaHostRegister(address, nbytes, int(flags)), "cudaHostRegister")

    def _host_unregister(self, address: int) -> None:
        check(self._cudart.cudaHostUnregister(address), "cudaHostUnregister")

    def _host_get_device_pointer(self, address: int) -> int:
        return int(check(self._cudart.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))

    def pointer_attributes(self, address: int) -> PointerAttributes:
        attrs = check(self._cudart.cudaPointerGetAttributes(address), "cudaPointerGetAttributes")
        kinds = self._cudart.cudaMemoryType
        kind = {kinds.cudaMemoryTypeHost: MemoryType.HOST, kinds.cudaMemoryTypeDevice: MemoryType.DEVICE,
                kinds.cudaMemoryTypeManaged: MemoryType.MANAGED}.get(attrs.type, MemoryType.UNREGISTERED)
        if kind is MemoryType.UNREGISTERED:
            return PointerAttributes(kind, None, None, None)
        return PointerAttributes(kind, int(attrs.device), int(attrs.devicePointer) or None,
                                 int(attrs.hostPointer) or None)

    def allocation_end(self, address: int) -> int | None:
        end = super().allocation_end(address)
        if end is not None:
            return end
        err, base, size = _driver().cuMemGetAddressRange(address)   # device allocations (torch's: a whole segment)
        return None if int(err) else int(base) + int(size)

    def device_alloc(self, nbytes: int, device: int) -> int:
        with self.using_device(device):
            return int(check(self._cudart.cudaMalloc(nbytes), "cudaMalloc"))

    def device_free(self, address: int) -> None:
        check(self._cudart.cudaFree(address), "cudaFree")

    def _memcpy(self, dst: Address, src: Address, nbytes: int) -> None:
        check(self._cudart.cudaMemcpy(dst.value, src.value, nbytes, self._memcpy_default), "cudaMemcpy")

    def _memcpy_async(self, dst: Address, src: Address, nbytes: int, stream: Stream) -> None:
        check(self._cudart.cudaMemcpyAsync(dst.value, src.value, nbytes, self._memcpy_default,
                                           self.as_stream(stream).native), "cudaMemcpyAsync")

    def _memcpy_run_sets(self, sets: list[RunSet], stream: Stream, batched: bool) -> None:
        """Plain integers from here on (one array add per side, no object per copy): one cudaMemcpy2DAsync per
        strided group, then the other copies one cudaMemcpyAsync each, or with ``batched`` in cudaMemcpyBatchAsync
        calls of BATCH_LIMIT copies, one batch for every set of the call. Each driver call costs ~5-10 µs of host
        time, more while the link is busy: a staged 1 GiB backup of random 1 MiB page runs spent 6-8 ms queuing 1,024
        calls, and a load queued after it started that late (H200, both directions: 71% of the both-ways ceiling;
        batched 75%). The batched API refuses
        stream capture and older drivers lack it: those fall back to one call each. It refuses the legacy default
        stream too: there a batch goes on a side stream (:meth:`_batch_stream`). With batching, strided groups of
        fewer than STRIDED_MIN_ROWS_BATCHED copies go in the batch instead, and host-to-device copies under
        BATCH_H2D_MIN_BYTES stay out of it (the driver takes 4-6 µs of host time for each such entry on the H200,
        against ~1 µs from 32 KiB up)."""
        stream = self.as_stream(stream)
        cudart = self._cudart
        batching = batched and self._batch_supported and not stream.capturing
        kind, native = self._memcpy_default, stream.native
        dsts: list[int] = []
        srcs: list[int] = []
        counts: list[int] = []
        for dst, dst_offsets, src, src_offsets, sizes in sets:
            groups = self.groups(dst, dst_offsets, src, src_offsets, sizes)
            h2d = isinstance(src, CpuAddress)
            slow = h2d & (sizes[groups[:, 0]] < BATCH_H2D_MIN_BYTES) if groups.size else np.zeros(0, bool)
            strided, single = split_groups(groups, np.where(batching & ~slow, STRIDED_MIN_ROWS_BATCHED, 2))
            for d, s, n, rows, dst_pitch, src_pitch in zip((dst.value + dst_offsets[strided[:, 0]]).tolist(),
                                                           (src.value + src_offsets[strided[:, 0]]).tolist(),
                                                           sizes[strided[:, 0]].tolist(), *strided[:, 1:].T.tolist(),
                                                           strict=True):
                check(cudart.cudaMemcpy2DAsync(d, dst_pitch, s, src_pitch, n, rows, kind, native),
                      "cudaMemcpy2DAsync")
            single = single[sizes[single] > 0]
            batchable = (sizes[single] >= BATCH_H2D_MIN_BYTES) | (not h2d) if batching else np.zeros(single.size, bool)
            each = self._copy_lists(dst, dst_offsets, src, src_offsets, sizes, single[~batchable])
            for d, s, n in zip(*each, strict=True):
                check(cudart.cudaMemcpyAsync(d, s, n, kind, native), "cudaMemcpyAsync")
            chosen = self._copy_lists(dst, dst_offsets, src, src_offsets, sizes, single[batchable])
            dsts += chosen[0]
            srcs += chosen[1]
            counts += chosen[2]
        batch = len(counts) if len(counts) > 1 else 0
        with self._batch_stream(stream, batch) as (target, batch_there):
            if batch_there and self._memcpy_batch(dsts, srcs, counts, target):
                return
            for d, s, n in zip(dsts, srcs, counts, strict=True):
                check(cudart.cudaMemcpyAsync(d, s, n, kind, target), "cudaMemcpyAsync")

    @staticmethod
    def _copy_lists(dst: Address, dst_offsets: np.ndarray, src: Address, src_offsets: np.ndarray, sizes: np.ndarray,
                    chosen: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """(destination addresses, source addresses, sizes) of the ``chosen`` copies, as plain integers."""
        return ((dst.value + dst_offsets[chosen]).tolist(), (src.value + src_offsets[chosen]).tolist(),
                sizes[chosen].tolist())

    def _memcpy_batch(self, dsts: list[int], srcs: list[int], counts: list[int], native: Any) -> bool:
        """cudaMemcpyBatchAsync calls of BATCH_LIMIT copies; False (nothing queued) where the driver lacks it."""
        cudart = self._cudart
        attrs = cudart.cudaMemcpyAttributes()
        attrs.srcAccessOrder = cudart.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        for start in range(0, len(counts), BATCH_LIMIT):
            end = min(start + BATCH_LIMIT, len(counts))
            status = cudart.cudaMemcpyBatchAsync(dsts[start:end], srcs[start:end], counts[start:end], end - start,
                                                 [attrs], [0], 1, native)[0]
            if status in (cudart.cudaError_t.cudaErrorNotSupported,
                          cudart.cudaError_t.cudaErrorCallRequiresNewerDriver) and start == 0:
                self._batch_supported = False
                return False
            check((status,), "cudaMemcpyBatchAsync")
        return True

    @contextmanager
    def _batch_stream(self, stream: CudaStream, copies: int) -> Iterator[tuple[Any, bool]]:
        """(native stream, batch there?) for ``copies`` copies to batch (0: none). The caller's stream, except that
        cudaMemcpyBatchAsync refuses the legacy default stream: there a batch goes on a side stream of the device
        joined by events (after all the legacy stream's earlier work, before any of its later work), so torch's
        default stream is not left with one driver call per copy; a batch too small to pay for the fork and join
        stays on the legacy stream, one call per copy."""
        if stream.handle not in LEGACY_STREAMS or copies < DETOUR_MIN_COPIES:
            yield stream.native, copies > 0 and stream.handle not in LEGACY_STREAMS
            return
        cudart = self._cudart
        with self._detour_lock, self.using_device(stream.device):
            side, fork, join = self._detour(stream.device)
            check(cudart.cudaEventRecord(fork, stream.native), "cudaEventRecord")
            check(cudart.cudaStreamWaitEvent(side.native, fork, 0), "cudaStreamWaitEvent")
            try:
                yield side.native, True
            finally:
                check(cudart.cudaEventRecord(join, side.native), "cudaEventRecord")
                check(cudart.cudaStreamWaitEvent(stream.native, join, 0), "cudaStreamWaitEvent")

    def _detour(self, device: int) -> tuple[CudaStream, Any, Any]:
        """The side stream and its fork and join events for ``device``, made once (caller holds the lock)."""
        if device not in self._detours:
            cudart = self._cudart
            side = self.create_stream(device)
            with self.using_device(device):
                events = [check(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming),
                                "cudaEventCreateWithFlags") for _ in range(2)]
            for event in events:
                weakref.finalize(side, _destroy, cudart.cudaEventDestroy, event)
            self._detours[device] = (side, *events)
        return self._detours[device]

    def _memcpy_2d_async(self, dst: Address, dst_pitch: int, src: Address, src_pitch: int, width: int, height: int,
                         stream: Stream) -> None:
        check(self._cudart.cudaMemcpy2DAsync(dst.value, dst_pitch, src.value, src_pitch, width, height,
                                             self._memcpy_default, self.as_stream(stream).native),
              "cudaMemcpy2DAsync")

    def create_stream(self, device: int | None = None) -> CudaStream:
        device = self.current_device() if device is None else device
        with self.using_device(device):
            handle = check(self._cudart.cudaStreamCreateWithFlags(self._cudart.cudaStreamNonBlocking),
                           "cudaStreamCreateWithFlags")
        return CudaStream(self._cudart, device, handle, owned=True)

    def _load_program(self, spec: ProgramSpec, device: int) -> Program:
        """Load the image for the device's compute capability into its primary context, once per runtime."""
        driver = _driver()
        image, origin = spec.image(self.device_attributes(device).arch)
        with self.using_device(device):
            module = check_driver(driver.cuModuleLoadData(image), "cuModuleLoadData")
        functions = {name: check_driver(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
                     for name in spec.names}
        return CudaProgram(spec, device, origin, module, functions)

    def _launch(self, program: Program, name: str, grid: int, block: int, args: list[KernelArg],
                stream: Stream, shared_bytes: int = 0) -> None:
        """cuLaunchKernel with each parameter packed in C layout; the pointer array and the packed values live until
        the call returns, which is all the driver needs."""
        if not isinstance(program, CudaProgram):
            raise WrongRuntime(f"{program!r} was not loaded by the CUDA runtime")
        native = self.as_stream(stream).native
        blob, offsets = pack_parameters(args, program.device)
        packed = ctypes.create_string_buffer(blob, len(blob))
        base = ctypes.addressof(packed)
        params = (ctypes.c_void_p * len(offsets))(*[base + offset for offset in offsets])
        function = program.functions[name]
        with self.using_device(program.device):
            if shared_bytes > program.shared_limits.get(name, 48 << 10):
                driver = _driver()
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check_driver(driver.cuFuncSetAttribute(function, attr, shared_bytes), "cuFuncSetAttribute")
                program.shared_limits[name] = shared_bytes
            check_driver(_driver().cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared_bytes, native,
                                                  ctypes.addressof(params), 0), "cuLaunchKernel")

    def supports_wait_value(self, device: int) -> bool:
        """64-bit stream memory operations: on by default since CUDA 12 (a driver module option before)."""
        supported = self._wait_value_support.get(device)
        if supported is None:
            driver = _driver()
            attr = driver.CUdevice_attribute
            name = next((n for n in ("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
                                     "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V2") if hasattr(attr, n)), None)
            handle = check_driver(driver.cuDeviceGet(self.check_device(device)), "cuDeviceGet")
            supported = name is not None and bool(check_driver(driver.cuDeviceGetAttribute(getattr(attr, name),
                                                                                            handle),
                                                               "cuDeviceGetAttribute"))
            self._wait_value_support[device] = supported
        return supported

    def _wait_value(self, stream: Stream, address: DeviceAddress, value: int) -> None:
        driver = _driver()
        with self.using_device(stream.device):
            check_driver(driver.cuStreamWaitValue64(self.as_stream(stream).native, address.value, value,
                                                    self._wait_geq), "cuStreamWaitValue64")

    def wrap_stream(self, handle: int, device: int) -> CudaStream:
        """Borrow a stream someone else owns (``torch.cuda.Stream.cuda_stream``); closing it does not destroy it."""
        return CudaStream(self._cudart, self.check_device(device), self._cudart.cudaStream_t(handle), owned=False)

    def as_stream(self, stream: Any) -> CudaStream:
        if isinstance(stream, CudaStream):
            return stream
        if hasattr(stream, "cuda_stream") and hasattr(stream, "device"):
            return self.wrap_stream(int(stream.cuda_stream), int(stream.device.index or 0))
        raise WrongRuntime(f"cuda runtime needs a CUDA or torch.cuda stream, got {stream!r}")

    def as_event(self, event: Any) -> CudaEvent:
        if isinstance(event, CudaEvent):
            return event
        if hasattr(event, "cuda_event") and hasattr(event, "record"):
            device = getattr(getattr(event, "device", None), "index", None)
            return CudaEvent(self._cudart, self.current_device() if device is None else int(device),
                             borrowed=self._cudart.cudaEvent_t(int(event.cuda_event)))
        raise WrongRuntime(f"cuda runtime needs a CUDA or torch.cuda event, got {event!r}")

    def _current_stream(self, device: int) -> CudaStream:
        """torch's current stream where torch has initialised CUDA (kvtier orders after the work torch queued),
        else the legacy default stream."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return self.wrap_stream(int(torch.cuda.current_stream(device).cuda_stream), device)
        return self.wrap_stream(0, device)

    def legacy_stream(self, device: int) -> CudaStream:
        return self.wrap_stream(0, device)

    def create_event(self, device: int | None = None, *, timing: bool = False) -> CudaEvent:
        """Reuses the handle of a dropped event when one has completed: creating an event costs ~11 µs on the H200
        host, and a per-layer load hands out one per layer (a completed handle behaves as a fresh one: recording
        replaces its state, and nothing else can still refer to it)."""
        device = self.current_device() if device is None else self.check_device(device)
        cudart = self._cudart
        spare = self._spare_events.setdefault((device, timing), [])
        try:
            handle = spare.pop()
        except IndexError:
            handle = None
        if handle is not None and cudart.cudaEventQuery(handle)[0] != cudart.cudaError_t.cudaSuccess:
            spare.insert(0, handle)  # its last record is still pending: not a fresh event yet
            handle = None
        if handle is not None:
            return CudaEvent(cudart, device, timing=timing, spare=spare, handle=handle)
        with self.using_device(device):
            return CudaEvent(cudart, device, timing=timing, spare=spare)


class CudaProgram(Program):
    def __init__(self, spec: ProgramSpec, device: int, origin: str, module: Any, functions: dict[str, Any]) -> None:
        self.spec, self.device, self.origin, self.module, self.functions = spec, device, origin, module, functions
        self.shared_limits: dict[str, int] = {}  # dynamic shared memory each kernel was opened up to


def nvrtc_compile(source: str, filename: str, options: list[str]) -> bytes:
    """A cubin from NVRTC (cuda-bindings); a failed compile raises KernelBuildError carrying the program log."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise KernelBuildError(f"JIT build needs cuda-bindings' NVRTC ({exc})") from exc

    def checked(result: Any, call: str, program: Any = None) -> Any:
        status, values = result[0], result[1:]
        if status == nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return values[0] if len(values) == 1 else values
        log = ""
        if program is not None:
            size = nvrtc.nvrtcGetProgramLogSize(program)[1]
            buffer = b" " * size
            nvrtc.nvrtcGetProgramLog(program, buffer)
            log = buffer.decode(errors="replace")
        raise KernelBuildError(f"{call}: {nvrtc.nvrtcGetErrorString(status)[1].decode()}\n{log}")

    program = checked(nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        checked(nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options]),
                "nvrtcCompileProgram", program)
        size = checked(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        checked(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return cubin


def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc

        status, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:
        raise KernelBuildError(f"NVRTC is not usable here: {exc}") from exc
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelBuildError(f"nvrtcVersion failed: {status}")
    return int(major), int(minor)
